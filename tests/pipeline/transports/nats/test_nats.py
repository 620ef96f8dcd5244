"""The NATS transport against a real nats-server: streams, cancellation, deaths, discovery.

Every test starts its own server (``nats_server`` fixture, ~30 ms). Workers run in the
test's process unless a test needs to ``kill -9`` one; then ``worker_process`` runs it.
"""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

import nats
from anyio.abc import Process
from nats.aio.client import Client

from operators.backend import Backend
from operators.contracts.llm import BackendOutput, EngineOutput, PreprocessedRequest, StopConditions
from operators.migration import Migration
from operators.testing import make_request
from pipeline import (
    CapacityExhausted,
    ConnectFailed,
    Context,
    Direct,
    EngineError,
    FunctionEngine,
    InvalidRequest,
    LeastLoaded,
    Random,
    ResponseTimeout,
    RoundRobin,
    Router,
    StreamDisconnected,
    WorkerSet,
    link,
    open_stream,
)
from pipeline.testing import ScriptedEngine, collect, make_context
from pipeline.transports.codec import MsgpackCodec
from pipeline.transports.nats import (
    NatsDiscovery,
    NatsTimeouts,
    NatsWorker,
    RemoteEngine,
    serve,
)
from pipeline.transports.nats import connect as connect_nats
from tests.helpers.nats_server import NatsServer, connect, settle
from tests.pipeline.transports.nats.ready_process import ready_process
from tests.pipeline.transports.nats.worker_process import CODEC, MODEL, SCRIPT, Countdown

pytestmark = pytest.mark.slow  # every test starts a nats-server


#: a short registration TTL, so that a dead worker's key expires within the test
FAST = NatsTimeouts(ttl=1, drain=2.0)


async def wait_until(condition: Callable[[], bool], within: float = 3.0) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds.

    The conditions are about other processes and the server, which no Event can signal.
    """
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def outcome(engine: Any, ctx: Context[Any]) -> tuple[list[Any], Any]:
    """The items a stream gave and how it ended: None, or (error type, message, param)."""
    items: list[Any] = []
    try:
        async with open_stream(engine, ctx) as stream:
            async for item in stream:
                items.append(item)
    except Exception as exc:
        return items, (type(exc), str(exc), getattr(exc, "param", None))
    return items, None


@asynccontextmanager
async def serving(engine: Any, nc: Client, **options: Any) -> AsyncIterator[NatsWorker[Any, Any]]:
    options.setdefault("model", "m")
    options.setdefault("timeouts", FAST)
    async with serve(engine, nc=nc, **options) as worker:
        yield worker


# -- streams: the remote engine behaves like the local one ------------------------------------

SCRIPTS: dict[str, tuple[Iterable[Any], Any]] = {
    "items": (["a", "b", "c"], None),
    "empty": ([], None),
    "json-like values": ([{"k": [1, 2.5, None, True]}, "s", 3, b"\x00\xff"], None),
    "engine error": (["a"], EngineError("boom")),
    "invalid request": (["a", "b"], InvalidRequest("too long", param="max_tokens")),
    "capacity": ([], CapacityExhausted("full")),
    "worker lost": (["a"], StreamDisconnected("lost downstream")),
}


@pytest.mark.parametrize("route", ["model", "worker"])
@pytest.mark.parametrize(("outputs", "then"), SCRIPTS.values(), ids=SCRIPTS.keys())
async def test_a_remote_stream_equals_the_local_one(
    nc: Client, worker_nc: Client, route: str, outputs: Iterable[Any], then: Any
) -> None:
    engine: ScriptedEngine[Any] = ScriptedEngine(outputs, then=then)
    local = await outcome(engine, make_context("request"))
    async with serving(engine, worker_nc, worker_id="w1"):
        remote_engine: RemoteEngine[str, Any] = (
            RemoteEngine(nc, model="m") if route == "model" else RemoteEngine(nc, worker_id="w1")
        )
        before = len(anyio.get_running_tasks())
        remote = await outcome(remote_engine, make_context("request"))
        await wait_until(lambda: len(anyio.get_running_tasks()) <= before)
    assert remote == local
    assert engine.requests[-1].data == "request"


async def test_an_error_from_outside_the_hierarchy_arrives_as_an_engine_error(
    nc: Client, worker_nc: Client
) -> None:
    async with serving(ScriptedEngine(["a"], then=ValueError("bad value")), worker_nc):
        items, ended = await outcome(RemoteEngine(nc, model="m"), make_context("request"))
    assert items == ["a"]
    assert ended == (EngineError, "ValueError: bad value", None)


async def test_the_request_carries_id_payload_deadline_and_metadata(
    nc: Client, worker_nc: Client
) -> None:
    codec = CODEC
    request = PreprocessedRequest(token_ids=[5, 6], stop=StopConditions(stop=("\n",)))
    engine = ScriptedEngine(lambda ctx: [EngineOutput(token_ids=list(ctx.data.token_ids))])
    async with serving(engine, worker_nc, codec=codec):
        ctx = make_context(request, metadata={"tenant": "t1"}, timeout=5.0)
        outputs = await collect(RemoteEngine(nc, model="m", codec=codec), ctx)
    assert outputs == [EngineOutput(token_ids=[5, 6])]
    seen = engine.requests[0]
    assert seen.id == ctx.id
    assert seen.data == request
    assert isinstance(seen.data.stop.stop, tuple)
    assert seen.metadata == {"tenant": "t1"}
    assert ctx.deadline is not None
    assert seen.deadline is not None
    assert abs(seen.deadline - ctx.deadline) < 0.5


async def test_no_worker_means_connect_failed(nc: Client) -> None:
    with pytest.raises(ConnectFailed):
        await collect(RemoteEngine(nc, model="nobody"), make_context("request"))
    with pytest.raises(ConnectFailed):
        await collect(RemoteEngine(nc, worker_id="nobody"), make_context("request"))


async def test_an_unregistered_payload_type_is_an_engine_error(
    nc: Client, worker_nc: Client
) -> None:
    async with serving(ScriptedEngine([EngineOutput(token_ids=[1])]), worker_nc):
        with pytest.raises(EngineError, match="EngineOutput"):
            await collect(RemoteEngine(nc, model="m"), make_context("request"))
        with pytest.raises(EngineError, match="cannot encode the request"):
            await collect(RemoteEngine(nc, model="m"), make_context(object()))


FRAMES: dict[str, tuple[list[Any], list[str], type[Exception], str]] = {
    "a gap": (
        [[0, 0, "raw"], [1, 1, "a"], [3, 1, "c"]],
        ["a"],
        StreamDisconnected,
        "frames from worker raw were lost (expected #2, got #3)",
    ),
    "an unknown error class": (
        [[0, 0, "raw"], [1, 3, ["KeyError", "'x'", None, None]]],
        [],
        EngineError,
        "KeyError: 'x'",
    ),
    "a malformed frame": ([[0, 0, "raw"], "not a frame"], [], EngineError, "cannot decode"),
    "an unknown kind": ([[0, 0, "raw"], [1, 9, None]], [], StreamDisconnected, "unknown frame"),
}


@pytest.mark.parametrize(
    ("frames", "items", "error", "message"), FRAMES.values(), ids=FRAMES.keys()
)
async def test_what_a_broken_worker_sends_is_reported(
    nats_server: NatsServer,
    nc: Client,
    frames: list[Any],
    items: list[str],
    error: type[Exception],
    message: str,
) -> None:
    codec = MsgpackCodec()
    raw = await connect(nats_server)

    async def answer(msg: Any) -> None:
        for frame in frames:
            await raw.publish(msg.reply, codec.encode(frame))

    await raw.subscribe("llm-pipeline.worker.raw", cb=answer)
    await settle(raw)
    try:
        with pytest.raises(error, match=re.escape(message)) as raised:
            assert await collect(RemoteEngine(nc, worker_id="raw"), make_context("x")) == items
    finally:
        await raw.close()
    assert raised.value.request_id is not None


# -- cancellation, both ways -------------------------------------------------------------------


async def test_kill_reaches_the_worker(nc: Client, worker_nc: Client) -> None:
    engine: ScriptedEngine[str] = ScriptedEngine(["a"], then="hang")
    async with serving(engine, worker_nc) as worker:
        ctx = make_context("request")
        async with open_stream(RemoteEngine(nc, model="m"), ctx) as stream:
            async for item in stream:
                assert item == "a"
                await engine.hanging.wait()
                ctx.kill()  # cancels this block at once
        await wait_until(lambda: engine.requests[0].is_killed, within=1.0)
        await wait_until(lambda: worker.statistics().in_flight == 0, within=1.0)
    assert ctx.is_killed


async def test_closing_the_stream_early_kills_the_worker_side(
    nc: Client, worker_nc: Client
) -> None:
    engine: ScriptedEngine[str] = ScriptedEngine(["a", "b"], then="hang")
    async with serving(engine, worker_nc) as worker:
        async with open_stream(RemoteEngine(nc, model="m"), make_context("request")) as stream:
            async for item in stream:
                assert item == "a"
                break
        await wait_until(lambda: engine.requests[0].is_killed, within=1.0)
        await wait_until(lambda: worker.statistics().in_flight == 0, within=1.0)
    assert engine.closed_early


async def test_stop_generating_reaches_the_worker(nc: Client, worker_nc: Client) -> None:
    engine: ScriptedEngine[str] = ScriptedEngine(["a"], then="hang")
    async with serving(engine, worker_nc):
        ctx = make_context("request")
        with anyio.fail_after(1.0):
            async with open_stream(RemoteEngine(nc, model="m"), ctx) as stream:
                outputs = [await stream.__anext__()]
                await engine.hanging.wait()
                ctx.stop_generating()
                outputs += [item async for item in stream]  # a clean end, no error
    assert outputs == ["a"]
    seen = engine.requests[0]
    assert seen.is_stopped
    assert not seen.is_killed
    assert engine.completed == 1


async def test_outputs_in_flight_when_stopped_are_dropped(nc: Client, worker_nc: Client) -> None:
    """A stopped stream yields nothing more, even what the worker sent before it heard."""
    engine: ScriptedEngine[int] = ScriptedEngine(range(200), then="hang")
    async with serving(engine, worker_nc):
        ctx = make_context("request")
        with anyio.fail_after(2.0):
            async with open_stream(RemoteEngine(nc, model="m"), ctx) as stream:
                first = await stream.__anext__()
                await engine.hanging.wait()  # all 200 sent, within the credit window
                ctx.stop_generating()
                rest = [item async for item in stream]
    assert (first, rest) == (0, [])
    assert engine.requests[0].is_stopped
    assert not engine.requests[0].is_killed


async def endless(ctx: Context[Any]) -> AsyncIterator[int]:
    """Counts until stopped, one number per 10 ms."""
    count = 0
    while not ctx.is_stopped:
        await anyio.sleep(0.01)
        yield count
        count += 1


@pytest.mark.parametrize(
    "engine",
    [FunctionEngine(endless), ScriptedEngine(["a"], then="hang")],
    ids=["while-generating", "while-silent"],
)
async def test_a_vanished_client_stops_the_worker(
    nats_server: NatsServer, worker_nc: Client, engine: Any
) -> None:
    seen: list[Context[Any]] = []

    async def recording(ctx: Context[Any]) -> AsyncIterator[Any]:
        seen.append(ctx)
        async for item in engine.generate(ctx):
            yield item

    async with serving(FunctionEngine(recording), worker_nc, worker_id="w1") as worker:
        # A client that sends a request, never reads the answer, and goes away.
        crashing = await connect(nats_server)
        inbox = crashing.new_inbox()
        await crashing.subscribe(inbox)
        request = {"id": "r1", "data": "request", "timeout": None, "metadata": {}}
        await crashing.publish(worker.subject, MsgpackCodec().encode(request), reply=inbox)
        await wait_until(lambda: worker.statistics().in_flight == 1)
        await crashing.close()
        await wait_until(lambda: worker.statistics().in_flight == 0, within=1.5)
    assert seen[0].is_killed
    assert worker.statistics().clients_gone == 1


# -- a slow worker is not a dead one -----------------------------------------------------------


async def slow_prefill(ctx: Context[Any]) -> AsyncIterator[str]:
    await anyio.sleep(1.0)
    yield "first token"


@pytest.mark.parametrize("heartbeat", [0.1, 30.0], ids=["heartbeats", "pings-only"])
async def test_a_slow_first_token_is_not_a_lost_worker(
    nc: Client, worker_nc: Client, heartbeat: float
) -> None:
    worker_timeouts = NatsTimeouts(ttl=1, heartbeat=heartbeat)
    client_timeouts = NatsTimeouts(idle=0.2, ping=0.5)
    async with serving(FunctionEngine(slow_prefill), worker_nc, timeouts=worker_timeouts):
        remote: RemoteEngine[str, str] = RemoteEngine(nc, model="m", timeouts=client_timeouts)
        assert await collect(remote, make_context("request")) == ["first token"]


# -- graceful shutdown -------------------------------------------------------------------------


async def test_a_graceful_stop_drains_in_flight_requests_and_deregisters(
    nc: Client, worker_nc: Client
) -> None:
    engine: Countdown = Countdown(delay=0.02)
    workers: WorkerSet[PreprocessedRequest, EngineOutput] = WorkerSet(MODEL)
    async with NatsDiscovery(nc, model=MODEL, codec=CODEC).watch(workers):
        async with serving(engine, worker_nc, model=MODEL, codec=CODEC, worker_id="w1") as worker:
            await wait_until(lambda: "w1" in workers)
            ctx = make_context(PreprocessedRequest(token_ids=[1]))
            async with open_stream(Router(workers), ctx) as stream:
                outputs = [await anext(stream)]
                worker.stop()  # while the request is in flight
                await worker.serve_forever()
                outputs.extend([output async for output in stream])
        assert "w1" not in workers
    assert [output.token_ids[0] for output in outputs] == SCRIPT


async def test_a_stop_cuts_off_what_outlives_the_drain_deadline(
    nc: Client, worker_nc: Client
) -> None:
    engine: ScriptedEngine[str] = ScriptedEngine(["a"], then="hang")
    timeouts = NatsTimeouts(ttl=1, drain=0.1)
    ctx = make_context("request")
    async with anyio.create_task_group() as tg:
        worker = await tg.start(serve(engine, nc=worker_nc, model="m", timeouts=timeouts).run)

        async def stop_when_hanging() -> None:
            await engine.hanging.wait()
            worker.stop()

        tg.start_soon(stop_when_hanging)
        items, ended = await outcome(RemoteEngine(nc, model="m"), ctx)
    assert items == ["a"]
    assert ended is not None
    assert ended[0] is StreamDisconnected
    assert "shut down" in ended[1]


@pytest.mark.parametrize("when", ["serving", "draining"])
async def test_a_worker_cancelled_mid_stream_ends_it_with_an_error_frame(
    nc: Client, worker_nc: Client, when: str
) -> None:
    engine: ScriptedEngine[str] = ScriptedEngine(["a"], then="hang")
    # The client never pings within the test: only a frame from the worker can end it.
    patient: RemoteEngine[str, str] = RemoteEngine(nc, model="m", timeouts=NatsTimeouts(idle=60.0))
    workers: WorkerSet[Any, str] = WorkerSet("m")
    worker_scope = anyio.CancelScope()

    async def run_worker(*, task_status: anyio.abc.TaskStatus[NatsWorker[Any, Any]]) -> None:
        with worker_scope:
            timeouts = NatsTimeouts(ttl=1, drain=60.0)
            await serve(engine, nc=worker_nc, model="m", timeouts=timeouts).run(
                task_status=task_status
            )

    async def cut_off(worker: NatsWorker[Any, Any]) -> None:
        await engine.hanging.wait()
        if when == "draining":
            worker.stop()
            await wait_until(lambda: worker.worker_id not in workers)  # it deregistered
        worker_scope.cancel()  # a second Ctrl-C: the drain (or the serving) is cut short

    async with NatsDiscovery(nc, model="m").watch(workers), anyio.create_task_group() as tg:
        worker = await tg.start(run_worker)
        tg.start_soon(cut_off, worker)
        items, ended = await outcome(patient, make_context("request"))
    assert items == ["a"]
    assert ended is not None
    assert ended[0] is StreamDisconnected
    assert "shut down" in ended[1]
    assert engine.requests[0].is_killed or engine.closed_early


# -- dead workers: kill -9 ---------------------------------------------------------------------


def worker_process(
    url: str, worker_id: str, ttl: float = 1
) -> AbstractAsyncContextManager[Process]:
    """``worker_process`` serving Countdown as ``worker_id``; killed on exit."""
    return ready_process("tests.pipeline.transports.nats.worker_process", url, worker_id, str(ttl))


async def test_a_killed_worker_fails_its_streams_by_ping_and_by_ttl(
    nats_server: NatsServer, nc: Client
) -> None:
    workers: WorkerSet[PreprocessedRequest, EngineOutput] = WorkerSet(MODEL)
    # The discovered engine never pings (idle 30 s): only the key's expiry can fail it.
    patient = NatsTimeouts(idle=30.0)
    discovery = NatsDiscovery(nc, model=MODEL, codec=CODEC, timeouts=patient)
    async with discovery.watch(workers), worker_process(nats_server.url, "doomed") as process:
        await wait_until(lambda: "doomed" in workers)
        direct: RemoteEngine[PreprocessedRequest, EngineOutput] = RemoteEngine(
            nc, worker_id="doomed", codec=CODEC
        )
        discovered = workers.members[0].engine
        ended: dict[str, tuple[float, Any]] = {}
        killed_at = 0.0

        async def consume(name: str, engine: Any) -> None:
            items, how = await outcome(engine, make_context(make_request()))
            assert len(items) >= 3
            ended[name] = (anyio.current_time() - killed_at, how)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "ping", direct)
            tg.start_soon(consume, "ttl", discovered)
            await anyio.sleep(0.15)  # both streams are flowing
            process.send_signal(signal.SIGKILL)
            killed_at = anyio.current_time()
        await wait_until(lambda: "doomed" not in workers)

    after, how = ended["ping"]
    assert how is not None
    assert how[0] is StreamDisconnected
    assert after < 1.2, f"the ping found the dead worker only after {after:.2f}s"
    after, how = ended["ttl"]
    assert how is not None
    assert how[0] is StreamDisconnected
    assert "expired" in how[1]
    assert after < 3.0


async def test_a_stopped_worker_process_times_out(nats_server: NatsServer, nc: Client) -> None:
    timeouts = NatsTimeouts(idle=0.2, ping=0.3)
    async with worker_process(nats_server.url, "frozen") as process:
        remote: RemoteEngine[PreprocessedRequest, EngineOutput] = RemoteEngine(
            nc, worker_id="frozen", codec=CODEC, timeouts=timeouts
        )
        async with open_stream(remote, make_context(make_request())) as stream:
            await anext(stream)
            process.send_signal(signal.SIGSTOP)  # alive to the server, deaf to pings
            with pytest.raises(ResponseTimeout), anyio.fail_after(2.0):
                async for _ in stream:
                    pass


class CharTokenizer:
    """Token id n is the character chr(n)."""

    def decode_stream(self, *, skip_special_tokens: bool, prompt_ids: Any = ()) -> Any:
        return self

    def step(self, token_id: int) -> str:
        return chr(token_id)


async def test_migration_finishes_a_killed_workers_stream_on_another_worker(
    nats_server: NatsServer, nc: Client, worker_nc: Client
) -> None:
    workers: WorkerSet[PreprocessedRequest, EngineOutput] = WorkerSet(MODEL)
    events: list[tuple[str, str]] = []
    survivor = Countdown()
    graph = link(
        Migration(limit=3, on_event=lambda where, what: events.append((where, what))),
        Backend(CharTokenizer()),
        Router(workers, RoundRobin()),
    )
    async with (
        NatsDiscovery(nc, model=MODEL, codec=CODEC).watch(workers),
        worker_process(nats_server.url, "doomed") as process,
    ):
        await wait_until(lambda: "doomed" in workers)
        async with serving(survivor, worker_nc, model=MODEL, codec=CODEC, worker_id="survivor"):
            await wait_until(lambda: "survivor" in workers)
            assert workers.members[0].id == "doomed"  # round robin starts there
            outputs: list[BackendOutput] = []
            async with open_stream(graph, make_context(make_request())) as stream:
                async for output in stream:
                    outputs.append(output)
                    if len(outputs) == 5:
                        process.send_signal(signal.SIGKILL)
    assert "".join(output.text for output in outputs) == "".join(map(chr, SCRIPT))
    assert events == [("stream", "retried")]
    assert survivor.requests[0].replayed_tokens >= 5


# -- eviction: a dead worker leaves its WorkerSet at the first "no responders" ------------------

#: a registration that outlives every test: only eviction can take a dead worker out
LONG_TTL = 30


def graph_over(
    workers: WorkerSet[PreprocessedRequest, EngineOutput],
    policy: Any,
    events: list[tuple[str, str]],
    limit: int,
) -> Any:
    return link(
        Migration(limit=limit, on_event=lambda where, what: events.append((where, what))),
        Backend(CharTokenizer()),
        Router(workers, policy),
    )


def text(outputs: list[BackendOutput]) -> str:
    return "".join(output.text for output in outputs)


@pytest.mark.parametrize(
    "policy", [RoundRobin(), Random(seed=3), LeastLoaded()], ids=lambda p: type(p).__name__
)
async def test_a_dead_worker_is_evicted_by_the_first_request_that_finds_it_gone(
    nats_server: NatsServer, nc: Client, worker_nc: Client, policy: Any
) -> None:
    workers: WorkerSet[PreprocessedRequest, EngineOutput] = WorkerSet(MODEL)
    events: list[tuple[str, str]] = []
    survivor = Countdown(delay=0.001)
    async with (
        NatsDiscovery(nc, model=MODEL, codec=CODEC).watch(workers),
        worker_process(nats_server.url, "doomed", ttl=LONG_TTL) as process,
        serving(survivor, worker_nc, model=MODEL, codec=CODEC, worker_id="survivor"),
    ):
        await wait_until(lambda: "doomed" in workers and "survivor" in workers)
        process.kill()
        await process.wait()
        # One retry in all: once a request found the dead worker gone, no other request
        # and no retry is sent there (Migration allows a request one retry only).
        graph = graph_over(workers, policy, events, limit=1)
        for _ in range(8):
            assert text(await collect(graph, make_context(make_request()))) == "".join(
                map(chr, SCRIPT)
            )
        assert "doomed" not in workers
    assert events == [("connect", "retried")]
    assert len(survivor.requests) == 8


async def test_a_dead_worker_found_by_a_ping_is_evicted_and_its_streams_migrate_at_once(
    nats_server: NatsServer, nc: Client, worker_nc: Client
) -> None:
    workers: WorkerSet[PreprocessedRequest, EngineOutput] = WorkerSet(MODEL)
    events: list[tuple[str, str]] = []
    survivor = Countdown(delay=0.001)
    graph = graph_over(workers, RoundRobin(), events, limit=3)
    texts: list[str] = []
    async with (
        NatsDiscovery(nc, model=MODEL, codec=CODEC).watch(workers),
        worker_process(nats_server.url, "doomed", ttl=LONG_TTL) as process,
    ):
        await wait_until(lambda: "doomed" in workers)
        flowing = [anyio.Event() for _ in range(3)]

        async def consume(flowing: anyio.Event) -> None:
            outputs: list[BackendOutput] = []
            async with open_stream(graph, make_context(make_request())) as stream:
                async for output in stream:
                    outputs.append(output)
                    if len(outputs) == 3:
                        flowing.set()
            texts.append(text(outputs))

        async with anyio.create_task_group() as tg:
            for event in flowing:  # all three on the doomed worker, its set's only member
                tg.start_soon(consume, event)
            for event in flowing:
                await event.wait()
            async with serving(survivor, worker_nc, model=MODEL, codec=CODEC, worker_id="survivor"):
                await wait_until(lambda: "survivor" in workers)
                process.kill()
                await process.wait()
                await wait_until(lambda: len(texts) == 3)
                # Out at the first ping, long before its key (30 s) would have expired.
                assert "doomed" not in workers
    assert texts == ["".join(map(chr, SCRIPT))] * 3
    # One retry each, all on the survivor: the first ping evicted the worker and failed
    # the other two streams with it.
    assert events == [("stream", "retried")] * 3
    assert len(survivor.requests) == 3


async def test_an_evicted_worker_that_is_alive_comes_back_when_it_refreshes(
    nc: Client, worker_nc: Client
) -> None:
    workers: WorkerSet[Any, str] = WorkerSet("m")
    timeouts = NatsTimeouts(ttl=1)
    async with (
        NatsDiscovery(nc, model="m").watch(workers),
        serving(ScriptedEngine(["a"]), worker_nc, worker_id="w1", timeouts=timeouts) as worker,
    ):
        await wait_until(lambda: "w1" in workers)
        engine = workers.members[0].engine
        # Its request subscription goes away (as while a server restarts): evicted at once.
        subscription = next(
            sub for sub in worker_nc._subs.values() if sub.subject == worker.subject
        )
        await subscription.unsubscribe()
        await settle(worker_nc)
        with pytest.raises(ConnectFailed):
            await collect(engine, make_context("x"))
        assert "w1" not in workers
        # It refreshes its registration (every ttl/3): only a live worker does that.
        await wait_until(lambda: "w1" in workers, within=2.0)
        assert await collect(RemoteEngine(nc, model="m"), make_context("x")) == ["a"]


# -- discovery ---------------------------------------------------------------------------------


async def three(ctx: Context[Any]) -> AsyncIterator[int]:
    for number in (1, 2, 3):
        await anyio.sleep(0.005)
        yield number


async def test_workers_join_and_leave_while_traffic_flows(nc: Client, worker_nc: Client) -> None:
    workers: WorkerSet[Any, int] = WorkerSet("m")
    router: Router[Any, int] = Router(workers, RoundRobin(), wait=2.0)
    results: list[list[int]] = []
    failures: list[BaseException] = []
    done = anyio.Event()

    async def client() -> None:
        while not done.is_set():
            try:
                results.append(await collect(router, make_context("request")))
            except Exception as exc:
                failures.append(exc)

    async with NatsDiscovery(nc, model="m").watch(workers), anyio.create_task_group() as tg:
        first = await tg.start(serve(FunctionEngine(three), nc=worker_nc, model="m").run)
        await wait_until(lambda: first.worker_id in workers)
        for _ in range(4):
            tg.start_soon(client)
        second = await tg.start(serve(FunctionEngine(three), nc=worker_nc, model="m").run)
        await wait_until(lambda: second.worker_id in workers)
        await wait_until(lambda: second.statistics().requests >= 5)
        first.stop()
        await wait_until(lambda: first.worker_id not in workers)
        served = len(results)
        await wait_until(lambda: len(results) >= served + 10)
        done.set()
        second.stop()
    assert failures == []
    assert all(result == [1, 2, 3] for result in results)
    assert first.statistics().requests >= 5


async def test_a_server_restart_reconnects_and_resyncs_discovery(
    nats_server: NatsServer, nc: Client, worker_nc: Client
) -> None:
    workers: WorkerSet[Any, int] = WorkerSet("m")
    router: Router[Any, int] = Router(workers, Direct(), wait=2.0)

    def to(worker_id: str) -> Context[str]:
        return make_context("request", metadata={"worker_id": worker_id})

    async with NatsDiscovery(nc, model="m").watch(workers), anyio.create_task_group() as tg:
        before = await tg.start(serve(FunctionEngine(three), nc=worker_nc, model="m").run)
        await wait_until(lambda: before.worker_id in workers)
        assert await collect(router, to(before.worker_id)) == [1, 2, 3]

        await anyio.to_thread.run_sync(nats_server.restart)
        await wait_until(lambda: nc.is_connected and worker_nc.is_connected, within=5.0)

        # A worker that registers after the restart is seen: the watch was renewed.
        after = await tg.start(serve(FunctionEngine(three), nc=worker_nc, model="m").run)
        await wait_until(lambda: after.worker_id in workers, within=5.0)
        assert await collect(router, to(after.worker_id)) == [1, 2, 3]
        with anyio.fail_after(5.0):
            while True:  # the old worker's subscriptions come back with its connection
                try:
                    assert await collect(router, to(before.worker_id)) == [1, 2, 3]
                    break
                except ConnectFailed:
                    await anyio.sleep(0.05)
        before.stop()
        await wait_until(lambda: before.worker_id not in workers)
        after.stop()


async def test_model_names_need_not_be_subject_tokens(nc: Client, worker_nc: Client) -> None:
    model = "org/smol.v1:q4 *"
    mine: WorkerSet[Any, str] = WorkerSet(model)
    other: WorkerSet[Any, str] = WorkerSet("org/smol.v1:q4")
    async with (
        NatsDiscovery(nc, model=model).watch(mine),
        NatsDiscovery(nc, model="org/smol.v1:q4").watch(other),
        serving(ScriptedEngine(["a"]), worker_nc, model=model, worker_id="w1"),
    ):
        await wait_until(lambda: "w1" in mine)
        assert await collect(RemoteEngine(nc, model=model), make_context("x")) == ["a"]
        assert await collect(Router(mine), make_context("x")) == ["a"]
        assert len(other) == 0


async def test_a_worker_runs_in_a_task_group_and_with_its_own_connection(
    nats_server: NatsServer, nc: Client
) -> None:
    async with anyio.create_task_group() as tg:
        worker = await tg.start(
            serve(ScriptedEngine(["a"]), url=nats_server.url, model="m", role="prefill").run
        )
        assert await collect(RemoteEngine(nc, model="m", role="prefill"), make_context("x")) == [
            "a"
        ]
        with pytest.raises(ConnectFailed):  # another role is another pool
            await collect(RemoteEngine(nc, model="m"), make_context("x"))
        worker.stop()


def test_bad_arguments_are_named() -> None:
    engine = ScriptedEngine(["a"])
    with pytest.raises(ValueError, match="exactly one of nc"):
        serve(engine, model="m")
    with pytest.raises(ValueError, match="role must be one of"):
        serve(engine, url="nats://x", model="m", role="prefil")
    with pytest.raises(ValueError, match="worker_id"):
        serve(engine, url="nats://x", model="m", worker_id="a.b")
    with pytest.raises(ValueError, match="ttl"):
        NatsTimeouts(ttl=0.5)
    client = nats.NATS()
    with pytest.raises(ValueError, match=r"model= .* or worker_id="):
        RemoteEngine(client)
    with pytest.raises(ValueError, match="window must be >= 1"):
        RemoteEngine(client, model="m", window=0)


# -- connecting --------------------------------------------------------------------------------


def unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_connect_gives_up_at_its_deadline_with_connect_failed() -> None:
    url = f"nats://127.0.0.1:{unused_port()}"
    before = len(anyio.get_running_tasks())
    with pytest.raises(ConnectFailed, match=r"no NATS server .* within 0\.3s") as raised:
        await connect_nats(url, give_up_after=0.3)
    assert raised.value.__cause__ is not None  # the last connection error, chained
    assert raised.value.request_id is None
    await wait_until(lambda: len(anyio.get_running_tasks()) <= before)


async def test_connect_reports_a_malformed_url_at_once() -> None:
    with anyio.fail_after(1.0), pytest.raises(ConnectFailed, match="cannot connect to NATS"):
        await connect_nats("nats://[bad", give_up_after=30.0)


async def test_connect_returns_a_client_that_reconnects(nats_server: NatsServer) -> None:
    nc = await connect_nats(nats_server.url, name="test", give_up_after=5.0)
    try:
        assert nc.is_connected
        assert nc.options["max_reconnect_attempts"] == -1
    finally:
        await nc.close()
