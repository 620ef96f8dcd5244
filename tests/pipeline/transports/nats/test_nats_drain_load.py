"""What a planner asks of workers over NATS: to drain (``drain_worker``, the ``[DRAIN]``
control message) and their load (``NatsLoadPublisher`` / ``NatsLoads``), against a real
nats-server."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import anyio
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from nats.aio.client import Client

from pipeline import (
    Context,
    FunctionEngine,
    PrefixIndex,
    Router,
    StreamDisconnected,
    WorkerSet,
    open_stream,
)
from pipeline.testing import make_context
from pipeline.transports.nats import (
    NatsDiscovery,
    NatsKvEvents,
    NatsLoadPublisher,
    NatsLoads,
    NatsTimeouts,
    RemoteEngine,
    drain_worker,
    kv_subject,
    serve,
)

pytestmark = pytest.mark.slow  # every test starts a nats-server


async def wait_until(condition: Callable[[], bool], within: float = 3.0) -> None:
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - the server and other clients: no event
            await anyio.sleep(0.01)


def gated(gate: anyio.Event, outputs: int = 5) -> FunctionEngine[str, int]:
    """Yields one output, waits for ``gate``, then the rest."""

    async def generate(ctx: Context[str]):  # type: ignore[no-untyped-def]
        yield 0
        await gate.wait()
        for index in range(1, outputs):
            yield index

    return FunctionEngine(generate)


async def test_a_worker_told_to_drain_leaves_discovery_at_once_and_finishes_its_streams(
    nc: Client, worker_nc: Client
) -> None:
    gate = anyio.Event()
    workers: WorkerSet[str, int] = WorkerSet("m")
    timeouts = NatsTimeouts(ttl=1, drain=10.0)
    async with NatsDiscovery(nc, model="m").watch(workers), anyio.create_task_group() as tg:
        worker = await tg.start(
            serve(gated(gate), nc=worker_nc, model="m", worker_id="w1", timeouts=timeouts).run
        )
        await wait_until(lambda: "w1" in workers)
        async with open_stream(Router(workers), make_context("request")) as stream:
            outputs = [await anext(stream)]
            assert await drain_worker(nc, "w1")
            await wait_until(lambda: "w1" not in workers)  # left routing before its stream ended
            assert worker.statistics().in_flight == 1
            gate.set()
            outputs.extend([output async for output in stream])
        with anyio.fail_after(3):
            await worker.serve_forever()  # it stopped serving by itself
    assert outputs == [0, 1, 2, 3, 4]


async def test_a_drain_cut_short_by_its_timeout_hands_the_stream_on(
    nc: Client, worker_nc: Client
) -> None:
    timeouts = NatsTimeouts(ttl=1, drain=0.2)
    async with anyio.create_task_group() as tg:
        await tg.start(
            serve(
                gated(anyio.Event()), nc=worker_nc, model="m", worker_id="w1", timeouts=timeouts
            ).run
        )
        items: list[int] = []
        with pytest.raises(StreamDisconnected, match="shut down"):
            async with open_stream(RemoteEngine(nc, model="m"), make_context("r")) as stream:
                async for item in stream:
                    items.append(item)
                    assert await drain_worker(nc, "w1")
    assert items == [0]


async def test_draining_a_worker_that_is_not_there_says_so(nc: Client) -> None:
    with anyio.fail_after(2):
        assert not await drain_worker(nc, "nobody")
    with pytest.raises(ValueError, match="worker_id must match"):
        await drain_worker(nc, "not a subject token")


async def test_a_load_is_published_when_it_changes_and_answered_when_asked(
    nc: Client, worker_nc: Client
) -> None:
    load: dict[str, Any] = {"waiting": 0, "decoding": 0}
    heard: list[tuple[str, Mapping[str, Any]]] = []
    publisher = NatsLoadPublisher(
        worker_nc, model="a model", worker_id="w1", load=lambda: load, every=0.05
    )
    loads = NatsLoads(nc, lambda worker_id, report: heard.append((worker_id, dict(report))))
    async with anyio.create_task_group() as tg:
        await tg.start(loads.run)
        await tg.start(publisher.run)
        assert await loads.ask("a model", "w1")
        assert heard == [("w1", {"waiting": 0, "decoding": 0})]
        load["waiting"] = 3
        publisher.changed()
        await wait_until(lambda: len(heard) == 2)
        assert heard[-1] == ("w1", {"waiting": 3, "decoding": 0})
        for waiting in (2, 1, 0):  # several changes within `every`: the last one goes out
            load["waiting"] = waiting
            publisher.changed()
        await wait_until(lambda: heard[-1][1]["waiting"] == 0)
        publisher.changed()  # nothing new: nothing sent
        await anyio.sleep(0.2)
        assert len(heard) <= 4
        assert publisher.published == len(heard) - 1  # (one was an answer)
        assert not await loads.ask("a model", "nobody", within=0.5)
        tg.cancel_scope.cancel()


async def test_kv_events_followers_and_load_followers_share_a_subject_in_peace(
    nc: Client, worker_nc: Client
) -> None:
    heard: list[str] = []
    loads = NatsLoads(nc, lambda worker_id, report: heard.append(worker_id))
    workers: WorkerSet[Any, Any] = WorkerSet("m")
    workers.add("w1", gated(anyio.Event()))
    index = PrefixIndex()
    events = NatsKvEvents(nc, model="m", index=index)
    async with anyio.create_task_group() as tg:
        await tg.start(loads.run)
        await tg.start(events.run, workers)
        # KV events without a load: the load follower skips them
        await worker_nc.publish(
            kv_subject("m", "w1"),
            b"\x82\xa6worker\xa2w1\xa6events\x90",  # msgpack {"worker": "w1", "events": []}
        )
        publisher = NatsLoadPublisher(
            worker_nc, model="m", worker_id="w1", load=lambda: {"waiting": 1}
        )
        await tg.start(publisher.run)
        publisher.changed()
        await wait_until(lambda: heard == ["w1"])
        assert events.statistics().events == 0
        assert len(index) == 0
        tg.cancel_scope.cancel()
