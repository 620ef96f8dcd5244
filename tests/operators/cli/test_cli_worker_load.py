"""A worker's load reports have one source (``operators.cli.nats.publish_load``): the
engine's own ``load_report()`` when it makes one and its KV publisher carries it, else what
the worker's ``RequestLog`` counts; never both on one subject, where a frontend's KV router
and a planner would read two different loads in turn. Against a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("nats", reason="the worker's load reports need the nats extra")

from nats.aio.client import Client

from operators.cli.nats import publish_kv_events, publish_load
from operators.contracts.llm import EngineOutput
from operators.contracts.transport import RequestLog
from operators.testing import make_request
from pipeline import Context, FunctionEngine, KvSnapshot, WorkerLoad, link, open_stream
from pipeline.testing import make_context
from pipeline.transports.nats import NatsLoads
from tests.helpers.nats_server import NatsServer, connect

pytestmark = pytest.mark.slow  # every test starts a nats-server

#: what the reporting engine always says (a load no RequestLog here could count)
REPORTED = WorkerLoad(prefill_tokens=777, decoding=5, waiting=2)


class ReportingEngine:
    """An engine that reports its load and has KV events (its cache off)."""

    kv_events: Any = None

    def kv_snapshot(self) -> KvSnapshot:
        raise AssertionError("not asked: its cache is off")

    def load_report(self) -> WorkerLoad:
        return REPORTED


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def clients(nats_server: NatsServer) -> AsyncIterator[tuple[Client, Client]]:
    """The planner's connection and the worker's."""
    planner, worker = await connect(nats_server), await connect(nats_server)
    yield planner, worker
    await worker.close()
    await planner.close()


async def wait_until(condition: Callable[[], bool], within: float = 3.0) -> None:
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - the reports come from the server: no event
            await anyio.sleep(0.01)


async def one_request(log: RequestLog, started: anyio.Event, release: anyio.Event) -> None:
    """A request of 3 prompt tokens through ``log``: held before its first output."""

    async def engine(ctx: Context[object]):  # type: ignore[no-untyped-def]
        started.set()
        await release.wait()
        yield EngineOutput(token_ids=[1], finish_reason="length")

    ctx = make_context(make_request(token_ids=[5, 6, 7]))
    async with open_stream(link(log, FunctionEngine(engine)), ctx) as stream:
        assert len([output async for output in stream]) == 1


async def test_an_engine_that_reports_its_load_is_the_only_source(
    clients: tuple[Client, Client],
) -> None:
    planner, worker = clients
    heard: list[Mapping[str, Any]] = []
    loads = NatsLoads(planner, lambda worker_id, load: heard.append(dict(load)))
    log, engine = RequestLog("w1"), ReportingEngine()
    started, release = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(loads.run)
        await publish_kv_events(tg, worker, engine, model="m", worker_id="w1")
        await publish_load(tg, worker, log, engine, model="m", worker_id="w1")
        await wait_until(lambda: len(heard) == 1)  # the engine's report, riding along
        tg.start_soon(one_request, log, started, release)
        await started.wait()  # the log counts it waiting: {"waiting": 1, "prefill": 3, ...}
        release.set()
        await wait_until(lambda: log.in_flight == 0)
        # The answer comes on the worker's connection after anything it published before.
        assert await loads.ask("m", "w1")
        tg.cancel_scope.cancel()
    # The engine's report once (it never changes; the log's changes sent nothing), then
    # the answer to the ask: the engine's too.
    assert heard == [REPORTED.to_dict()] * 2


async def test_without_a_report_of_its_own_the_request_log_is_published(
    clients: tuple[Client, Client],
) -> None:
    planner, worker = clients
    heard: list[Mapping[str, Any]] = []
    loads = NatsLoads(planner, lambda worker_id, load: heard.append(dict(load)))
    log, engine = RequestLog("w1"), object()  # no load_report, no KV events
    started, release = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(loads.run)
        assert not await publish_kv_events(tg, worker, engine, model="m", worker_id="w1")
        await publish_load(tg, worker, log, engine, model="m", worker_id="w1")
        tg.start_soon(one_request, log, started, release)
        await started.wait()
        await wait_until(lambda: {"waiting": 1, "decoding": 0, "prefill": 3} in heard)
        release.set()
        await wait_until(lambda: log.in_flight == 0)
        assert await loads.ask("m", "w1")
        tg.cancel_scope.cancel()
    assert heard[-1] == {"waiting": 0, "decoding": 0, "prefill": 0}  # the answer: now
    assert all(WorkerLoad.from_dict(load, 0.0) for load in heard)  # what a KV router reads
