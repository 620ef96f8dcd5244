"""KV events over NATS: workers publish, each frontend's PrefixIndex follows.

Workers run in the test's process with a :class:`FakeCache` whose events the test makes
(and can "lose": the cache changes, the event is never published), except for the death
test, which ``kill -9``s a ``kv_worker_process.py`` serving a caching mocker.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from anyio.abc import Process
from nats.aio.client import Client

from operators.contracts.llm import PreprocessedRequest, StopConditions
from operators.contracts.transport import llm_codec
from operators.routing.kv_blocks import request_block_ids
from pipeline import (
    ConnectFailed,
    Context,
    FunctionEngine,
    KvRouter,
    PrefixIndex,
    Router,
    Stream,
    Worker,
    WorkerLoad,
    WorkerSet,
)
from pipeline.kv_events import KvEvent, KvRemoved, KvSnapshot, KvStored
from pipeline.testing import collect, make_context
from pipeline.transports.nats import (
    NatsDiscovery,
    NatsKvEvents,
    NatsKvPublisher,
    NatsTimeouts,
    NatsWorker,
    kv_subject,
    serve,
)
from pipeline.transports.nats.bucket import DEFAULT_BUCKET, open_bucket
from pipeline.transports.nats.wire import control_codec
from tests.helpers.nats_server import NatsServer, connect
from tests.pipeline.transports.nats.kv_worker_process import BLOCK_SIZE
from tests.pipeline.transports.nats.kv_worker_process import MODEL as CACHING_MODEL
from tests.pipeline.transports.nats.ready_process import ready_process

pytestmark = pytest.mark.slow  # every test starts a nats-server

MODEL = "m"
#: a registration that outlives every test: only eviction can take a dead worker out
LONG = NatsTimeouts(ttl=30)


async def wait_until(condition: Callable[[], bool], within: float = 3.0) -> None:
    """Poll ``condition`` (about other clients and the server) until it holds."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.01)


class FakeCache:
    """A :class:`~pipeline.transports.nats.KvReporter` the test fills by hand."""

    def __init__(self) -> None:
        self.kv_events: Callable[[KvEvent], None] | None = None
        self.blocks: list[int] = []
        self.seq = 0

    def store(self, *ids: int, lose: bool = False) -> None:
        self.blocks += ids
        self._emit(KvStored(ids, self._next()), lose)

    def remove(self, *ids: int, lose: bool = False) -> None:
        self.blocks = [block for block in self.blocks if block not in ids]
        self._emit(KvRemoved(ids, self._next()), lose)

    def kv_snapshot(self) -> KvSnapshot:
        return KvSnapshot(tuple(self.blocks), self.seq)

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _emit(self, event: KvEvent, lose: bool) -> None:
        if self.kv_events is not None and not lose:
            self.kv_events(event)


def mirrors(index: PrefixIndex, worker_id: str, cache: FakeCache) -> bool:
    """Whether ``index`` believes of ``worker_id`` exactly what ``cache`` holds."""
    held = all(worker_id in index.holders(block) for block in cache.blocks)
    return held and index.blocks(worker_id) == len(cache.blocks)


async def two_tokens(ctx: Context[Any]) -> Stream[str]:
    yield "a"
    yield "b"


@asynccontextmanager
async def kv_worker(
    nc: Client, cache: FakeCache, worker_id: str
) -> AsyncIterator[NatsWorker[Any, str]]:
    """A registered worker whose KV events come from ``cache``."""
    publisher = NatsKvPublisher(cache, nc=nc, model=MODEL, worker_id=worker_id)
    async with anyio.create_task_group() as tg:
        await tg.start(publisher.run)
        assert publisher.active
        engine = FunctionEngine(two_tokens)
        async with serve(engine, nc=nc, model=MODEL, worker_id=worker_id, timeouts=LONG) as worker:
            yield worker
        tg.cancel_scope.cancel()


@asynccontextmanager
async def frontend(
    nc: Client, model: str = MODEL, codec: Any = None
) -> AsyncIterator[tuple[WorkerSet[Any, Any], NatsKvEvents]]:
    """Discovery and a KV feed for one frontend; yields its WorkerSet and the feed."""
    workers: WorkerSet[Any, Any] = WorkerSet(model)
    feed = NatsKvEvents(nc, model=model, index=PrefixIndex())
    async with (
        NatsDiscovery(nc, model=model, codec=codec).watch(workers),
        anyio.create_task_group() as tg,
    ):
        await tg.start(feed.run, workers)
        yield workers, feed
        tg.cancel_scope.cancel()


# -- the membership hook -----------------------------------------------------------------------


def test_a_worker_set_tells_its_listeners_of_joins_and_departures_only() -> None:
    workers: WorkerSet[Any, str] = WorkerSet("w", {"a": FunctionEngine(two_tokens)})
    heard: list[tuple[str, bool]] = []
    stop = workers.listen(lambda worker_id, joined: heard.append((worker_id, joined)))
    workers.add("b", FunctionEngine(two_tokens))
    workers.add("b", FunctionEngine(two_tokens))  # a new engine: no change of membership
    workers.remove("a")
    workers.remove("a")
    stop()
    workers.remove("b")
    stop()  # twice is harmless
    assert heard == [("b", True), ("a", False)]


def test_a_failing_listener_does_not_stop_the_change() -> None:
    workers: WorkerSet[Any, str] = WorkerSet("w")

    def broken(worker_id: str, joined: bool) -> None:
        raise RuntimeError("boom")

    workers.listen(broken)
    workers.add("a", FunctionEngine(two_tokens))
    assert "a" in workers


# -- events and snapshots ----------------------------------------------------------------------


async def test_events_reach_the_frontends_index(nc: Client, worker_nc: Client) -> None:
    cache = FakeCache()
    async with frontend(nc) as (workers, feed), kv_worker(worker_nc, cache, "w1"):
        await wait_until(lambda: "w1" in workers)
        cache.store(1, 2, 3)
        cache.store(4)
        await wait_until(lambda: mirrors(feed.index, "w1", cache))
        assert feed.index.overlaps([1, 2, 3, 4, 9]) == {"w1": 4}
        cache.remove(4)
        await wait_until(lambda: mirrors(feed.index, "w1", cache))
        assert feed.statistics().events == 3


async def test_a_frontend_that_starts_late_catches_up_by_snapshot(
    nc: Client, worker_nc: Client
) -> None:
    cache = FakeCache()
    async with kv_worker(worker_nc, cache, "w1"):
        cache.store(1, 2, 3)
        cache.store(7, 8)
        cache.remove(8)
        async with frontend(nc) as (_, feed):
            await wait_until(lambda: mirrors(feed.index, "w1", cache))
            assert feed.statistics().snapshots == 1
            cache.store(8, 9)  # and follows the events from there on
            await wait_until(lambda: mirrors(feed.index, "w1", cache))


async def test_a_lost_event_is_repaired_by_a_snapshot(nc: Client, worker_nc: Client) -> None:
    cache = FakeCache()
    async with frontend(nc) as (workers, feed), kv_worker(worker_nc, cache, "w1"):
        await wait_until(lambda: "w1" in workers and feed.statistics().requests >= 1)
        cache.store(1, 2)
        await wait_until(lambda: mirrors(feed.index, "w1", cache))
        snapshots = feed.statistics().snapshots
        cache.remove(2, lose=True)  # the frontend never hears of it...
        cache.store(5)  # ...until this event's number shows the gap
        await wait_until(lambda: mirrors(feed.index, "w1", cache))
        assert feed.index.holders(2) == frozenset()
        assert feed.statistics().snapshots == snapshots + 1


async def test_several_frontends_each_keep_their_own_index(
    nats_server: NatsServer, nc: Client, worker_nc: Client
) -> None:
    other = await connect(nats_server)
    cache = FakeCache()
    try:
        async with (
            frontend(nc) as (workers, feed),
            frontend(other) as (other_workers, other_feed),
            kv_worker(worker_nc, cache, "w1"),
        ):
            await wait_until(lambda: "w1" in workers and "w1" in other_workers)
            for block in range(10):
                cache.store(block)
            await wait_until(lambda: mirrors(feed.index, "w1", cache))
            await wait_until(lambda: mirrors(other_feed.index, "w1", cache))
            assert feed.index is not other_feed.index
    finally:
        await other.close()


async def test_the_index_survives_a_nats_server_restart(
    nats_server: NatsServer, nc: Client, worker_nc: Client
) -> None:
    cache = FakeCache()
    async with frontend(nc) as (workers, feed), kv_worker(worker_nc, cache, "w1"):
        await wait_until(lambda: "w1" in workers)
        cache.store(1, 2, 3)
        await wait_until(lambda: mirrors(feed.index, "w1", cache))

        nats_server.stop()
        await wait_until(lambda: not nc.is_connected and not worker_nc.is_connected)
        # Changes nobody hears of while the server is away, and no event after them:
        # only the snapshots asked for after the reconnection can tell the frontend.
        cache.remove(3, lose=True)
        cache.store(4, lose=True)
        await anyio.to_thread.run_sync(nats_server.start)

        await wait_until(lambda: mirrors(feed.index, "w1", cache), within=6.0)
        assert "w1" in workers
        cache.store(5)  # and events flow again
        await wait_until(lambda: mirrors(feed.index, "w1", cache))


async def test_a_departed_workers_blocks_leave_the_index_and_its_late_events_are_ignored(
    nc: Client, worker_nc: Client
) -> None:
    cache = FakeCache()
    async with frontend(nc) as (workers, feed):
        async with kv_worker(worker_nc, cache, "w1"):
            await wait_until(lambda: "w1" in workers)
            cache.store(1, 2)
            await wait_until(lambda: mirrors(feed.index, "w1", cache))
        # A graceful stop: deregistered on the way out.
        await wait_until(lambda: "w1" not in workers)
        assert feed.index.blocks("w1") == 0
        # An event from a worker that is no member (gone, or not discovered yet).
        from pipeline.transports.nats.wire import control_codec

        stray = {"worker": "w1", "events": [KvStored((9,), 3).to_dict()]}
        await worker_nc.publish(kv_subject(MODEL, "w1"), control_codec.encode(stray))
        await wait_until(lambda: feed.statistics().ignored == 1)
        assert feed.index.blocks("w1") == 0


async def test_an_engine_without_a_cache_publishes_nothing(nc: Client) -> None:
    class Off:
        kv_events: Any = None

        def __setattr__(self, name: str, value: Any) -> None:
            pass  # takes no sink, like a mocker whose cache is off

        def kv_snapshot(self) -> KvSnapshot:
            return KvSnapshot(())

    publisher = NatsKvPublisher(Off(), nc=nc, model=MODEL, worker_id="off")
    async with anyio.create_task_group() as tg:
        await tg.start(publisher.run)
    assert not publisher.active


# -- a killed worker ---------------------------------------------------------------------------


def caching_worker_process(url: str, worker_id: str) -> AbstractAsyncContextManager[Process]:
    """``kv_worker_process`` as ``worker_id`` (key TTL 30 s); killed on exit."""
    return ready_process("tests.pipeline.transports.nats.kv_worker_process", url, worker_id, "30")


@pytest.mark.time_limit(20)
async def test_a_killed_workers_blocks_are_gone_before_its_key_expires(
    nats_server: NatsServer, nc: Client
) -> None:
    def ask(prompt: list[int]) -> Context[PreprocessedRequest]:
        request = PreprocessedRequest(token_ids=prompt, stop=StopConditions(max_tokens=2))
        return make_context(request)

    async with frontend(nc, CACHING_MODEL, llm_codec()) as (workers, feed):
        index = feed.index
        router = Router(workers, KvRouter(index, request_block_ids(BLOCK_SIZE)))
        async with caching_worker_process(nats_server.url, "doomed") as process:
            await wait_until(lambda: "doomed" in workers)
            prompt = list(range(100, 112))  # three blocks
            await collect(router, ask(prompt))
            await wait_until(lambda: index.blocks("doomed") == 3)

            process.kill()  # SIGKILL: no deregistration, its key stays for 30 s
            await process.wait()
            assert process.returncode == -signal.SIGKILL
            # The next request routed there finds nobody on its subject: evicted at once.
            with pytest.raises(ConnectFailed):
                await collect(router, ask(prompt))
            assert "doomed" not in workers
            assert index.blocks("doomed") == 0
            assert index.overlaps(request_block_ids(BLOCK_SIZE)(ask(prompt))) == {}
            kv = await open_bucket(nc.jetstream(), DEFAULT_BUCKET)
            entry = await kv.get(f"{CACHING_MODEL}.aggregated.doomed")
            assert entry.value  # its discovery key has not expired


# -- load reports ride along -------------------------------------------------------------------


class LoadedCache(FakeCache):
    """A FakeCache whose engine also reports its load (``load_report()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.load: WorkerLoad | None = WorkerLoad(prefill_tokens=100, decoding=2)

    def load_report(self) -> WorkerLoad | None:
        return self.load


class LoadOnly:
    """An engine with no KV events (its cache is off) that reports its load."""

    def __init__(self) -> None:
        self.load = WorkerLoad(prefill_tokens=7, waiting=1)

    @property
    def kv_events(self) -> Callable[[KvEvent], None] | None:
        return None

    @kv_events.setter
    def kv_events(self, sink: Callable[[KvEvent], None] | None) -> None:
        pass  # its cache is off: it takes no sink

    @property
    def kv_snapshot(self) -> Callable[[], KvSnapshot]:
        raise AssertionError("never asked: its cache is off")

    def load_report(self) -> WorkerLoad:
        return self.load


def said(feed: NatsKvEvents, workers: WorkerSet[Any, Any], worker_id: str) -> WorkerLoad | None:
    worker = workers.get(worker_id)
    return None if worker is None else feed.load_report(worker)


async def test_load_reports_reach_the_frontend_with_events_and_alone(
    nc: Client, worker_nc: Client
) -> None:
    cache = LoadedCache()
    async with frontend(nc) as (workers, feed), kv_worker(worker_nc, cache, "w1"):
        await wait_until(lambda: "w1" in workers)
        cache.store(1, 2)  # an event: the load goes with it
        await wait_until(lambda: said(feed, workers, "w1") is not None)
        report = said(feed, workers, "w1")
        assert report is not None
        assert (report.prefill_tokens, report.decoding) == (100, 2)
        before = anyio.current_time()
        cache.load = WorkerLoad(prefill_tokens=5, decoding=9, kv_usage=0.5)  # no event
        await wait_until(lambda: (said(feed, workers, "w1") or report).decoding == 9)
        latest = said(feed, workers, "w1")
        assert latest is not None
        assert latest.kv_usage == 0.5
        assert latest.at >= before  # stamped when it came, on the frontend's clock


async def test_an_engine_without_kv_events_still_reports_its_load(
    nc: Client, worker_nc: Client
) -> None:
    engine = LoadOnly()
    publisher = NatsKvPublisher(engine, nc=worker_nc, model=MODEL, worker_id="w1")  # type: ignore[arg-type]
    async with frontend(nc) as (workers, feed), anyio.create_task_group() as tg:
        await tg.start(publisher.run)
        assert not publisher.active
        async with serve(FunctionEngine(two_tokens), nc=worker_nc, model=MODEL, worker_id="w1"):
            await wait_until(lambda: "w1" in workers)
            engine.load = WorkerLoad(prefill_tokens=70, waiting=3)
            await wait_until(lambda: (said(feed, workers, "w1") or WorkerLoad()).waiting == 3)
        await wait_until(lambda: "w1" not in workers)
        assert feed.load_report(Worker("w1", FunctionEngine(two_tokens))) is None  # it left
        tg.cancel_scope.cancel()


async def test_a_malformed_load_report_is_dropped_with_its_message(
    nc: Client, worker_nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    cache = FakeCache()
    async with frontend(nc) as (workers, feed), kv_worker(worker_nc, cache, "w1"):
        await wait_until(lambda: "w1" in workers)
        body = {"worker": "w1", "events": [], "load": {"prefill": -3, "decoding": 0}}
        await worker_nc.publish(kv_subject(MODEL, "w1"), control_codec.encode(body))
        cache.store(1)  # after it, in order
        await wait_until(lambda: mirrors(feed.index, "w1", cache))
        assert said(feed, workers, "w1") is None
        assert "malformed" in caplog.text
