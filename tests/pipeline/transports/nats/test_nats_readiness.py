"""A worker's readiness in discovery: one that says it is not ready leaves its frontends'
worker sets (routers go elsewhere) while its streams go on, and returns when it is ready.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from nats.aio.client import Client

from pipeline import Context, FunctionEngine, WorkerSet, open_stream
from pipeline.testing import make_context
from pipeline.transports.nats import NatsDiscovery, NatsTimeouts, serve

pytestmark = pytest.mark.slow  # every test starts a nats-server


async def wait_until(condition: Callable[[], bool], within: float = 3.0) -> None:
    """Poll ``condition`` (it changes in the NATS server's time) until it holds."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_a_worker_that_is_not_ready_leaves_the_set_and_its_streams_go_on(
    nc: Client, worker_nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipeline.transports.nats.discovery")
    hold = anyio.Event()

    async def two(ctx: Context[Any]) -> AsyncIterator[int]:
        yield 1
        await hold.wait()
        yield 2

    workers: WorkerSet[Any, int] = WorkerSet("m")
    timeouts = NatsTimeouts(ttl=1)
    async with (
        NatsDiscovery(nc, model="m").watch(workers),
        serve(
            FunctionEngine(two), nc=worker_nc, model="m", worker_id="w1", timeouts=timeouts
        ) as worker,
    ):
        await wait_until(lambda: "w1" in workers)
        engine = workers.members[0].engine
        async with open_stream(engine, make_context("x")) as stream:
            assert await stream.__anext__() == 1
            worker.set_ready(False, "engine stalled: no output for 5.0 s")
            await wait_until(lambda: "w1" not in workers)
            hold.set()
            assert [item async for item in stream] == [2]  # its stream went on
        # It stays out through its registration's refreshes (a ttl is 1 s here)...
        await anyio.sleep(1.2)
        assert "w1" not in workers
        assert "worker w1 is not ready: engine stalled: no output for 5.0 s" in caplog.text
        [stalled] = [r for r in caplog.records if "worker w1 is not ready" in r.message]
        assert stalled.levelno == logging.WARNING  # (it served, and stopped)
        worker.set_ready(True)  # ...and comes back once it says it is ready
        await wait_until(lambda: "w1" in workers)
    assert "worker w1 is ready again" in caplog.text


async def test_a_worker_not_ready_when_it_registers_joins_once_it_is_ready(
    nc: Client, worker_nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipeline.transports.nats.discovery")
    workers: WorkerSet[Any, int] = WorkerSet("m")
    worker = serve(FunctionEngine(lambda ctx: _one()), nc=worker_nc, model="m", worker_id="w2")
    worker.set_ready(False, "starting")
    async with NatsDiscovery(nc, model="m").watch(workers), worker:
        await anyio.sleep(0.3)  # (what it registered is replayed: it would be in by now)
        assert "w2" not in workers
        worker.set_ready(True)
        await wait_until(lambda: "w2" in workers)
    # A new worker's start is no warning, and it joins (it was never "ready" before).
    [starting] = [r for r in caplog.records if "worker w2 is not ready: starting" in r.message]
    assert starting.levelno == logging.INFO
    assert "worker w2 joined" in caplog.text
    assert "ready again" not in caplog.text


async def _one() -> AsyncIterator[int]:
    yield 1
