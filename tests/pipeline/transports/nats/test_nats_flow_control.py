"""Flow control over a real nats-server: a slow reader holds at most a window of outputs.

Core NATS has no back-pressure, so the client grants its worker credit (the request's
``window``, then CREDIT control messages as its consumer reads) and the worker stops
pulling outputs from its engine when it has sent all it may. The tests observe that
through counters (the worker's outputs sent and pauses, the client's buffered messages,
the engine's outputs produced), never through timing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from nats.aio.client import Client
from nats.aio.msg import Msg

from pipeline import Context, FunctionEngine, Stream, open_stream
from pipeline.testing import make_context
from pipeline.transports.codec import MsgpackCodec
from pipeline.transports.nats import NatsTimeouts, NatsWorker, RemoteEngine, serve, wire
from tests.helpers.nats_server import NatsServer, connect, settle

pytestmark = pytest.mark.slow  # every test starts a nats-server

#: heartbeats only where a test asks for them
QUIET = NatsTimeouts(ttl=1, heartbeat=60.0, drain=2.0)
CODEC = MsgpackCodec()


async def wait_until(condition: Callable[[], bool], within: float = 3.0) -> None:
    """Poll ``condition`` (about the worker's tasks and the server) until it holds."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - no event spans the server round trip
            await anyio.sleep(0.005)


class Firehose:
    """An engine whose outputs are always ready: it counts how many it was asked for."""

    def __init__(self, count: int | None = None) -> None:
        self.count = count
        self.produced = 0

    async def generate(self, ctx: Context[Any]) -> Stream[int]:
        while self.count is None or self.produced < self.count:
            await checkpoint()
            if ctx.is_stopped:
                return
            self.produced += 1
            yield self.produced - 1


@asynccontextmanager
async def serving(
    engine: Any, worker_nc: Client, timeouts: NatsTimeouts = QUIET
) -> AsyncIterator[NatsWorker[Any, Any]]:
    async with serve(
        engine, nc=worker_nc, model="m", codec=CODEC, timeouts=timeouts, register=False
    ) as worker:
        yield worker


async def test_a_slow_reader_holds_at_most_a_window(nc: Client, worker_nc: Client) -> None:
    window, total = 16, 400
    engine = Firehose(total)
    async with serving(engine, worker_nc) as worker:
        remote: RemoteEngine[Any, int] = RemoteEngine(
            nc, worker_id=worker.worker_id, codec=CODEC, timeouts=QUIET, window=window
        )
        items: list[int] = []
        async with open_stream(remote, make_context(None)) as stream:
            async for item in stream:
                items.append(item)
                if len(items) % 50 == 1:
                    # The reader dawdles: the worker fills the window and pauses.
                    await wait_until(lambda: worker.statistics().paused == 1)
                    stats = worker.statistics()
                    # It sent no more than it was granted, it asked the engine for one
                    # more at most (held back), and the reader holds no more.
                    assert stats.outputs - len(items) <= window
                    assert engine.produced == stats.outputs + 1
                    assert remote.statistics().buffered <= window
                    assert remote.statistics().in_flight == 1
        stats = worker.statistics()
    assert items == list(range(total))
    assert stats.pauses >= 8  # at least once per dawdle
    assert stats.paused == 0


async def test_a_fast_reader_never_waits_for_credit_per_token(
    nc: Client, worker_nc: Client
) -> None:
    # Credit is granted half a window at a time: about one CREDIT per 128 outputs read.
    engine = Firehose(4000)
    grants: list[Any] = []

    async def spy(msg: Msg) -> None:
        op, *args = wire.control_codec.decode(msg.data)
        if op == wire.CREDIT:
            grants.append(args[0])

    async with serving(engine, worker_nc) as worker:
        await nc.subscribe(worker.control_subject, cb=spy)
        await settle(nc)
        remote: RemoteEngine[Any, int] = RemoteEngine(
            nc, worker_id=worker.worker_id, codec=CODEC, timeouts=QUIET
        )
        items = [item async for item in remote.generate(make_context(None))]
    assert items == list(range(4000))
    assert len(grants) <= 4000 // (wire.DEFAULT_WINDOW // 2)
    assert grants == sorted(grants)  # totals, so a lost or late grant is harmless


async def test_a_paused_streams_heartbeats_are_not_queued(nc: Client, worker_nc: Client) -> None:
    timeouts = NatsTimeouts(ttl=1, heartbeat=0.02, drain=2.0)
    async with serving(Firehose(), worker_nc, timeouts) as worker:
        remote: RemoteEngine[Any, int] = RemoteEngine(
            nc, worker_id=worker.worker_id, codec=CODEC, timeouts=timeouts, window=2
        )
        async with open_stream(remote, make_context(None)) as stream:
            assert await anext(stream) == 0
            await wait_until(lambda: worker.statistics().paused == 1)
            messages = worker.statistics().messages
            # Ten heartbeats go out while the reader does not read...
            await wait_until(lambda: worker.statistics().messages >= messages + 10)
            await settle(worker_nc)
            await settle(nc)
            # ...and none of them waits in the buffer: only the one output sent unread.
            assert remote.statistics().buffered <= 1
            assert worker.statistics().paused == 1
            assert worker.statistics().outputs == 2
            assert [await anext(stream) for _ in range(20)] == list(range(1, 21))


@pytest.mark.parametrize("how", ["closes its stream", "vanishes"])
async def test_a_client_that_leaves_a_paused_stream_frees_the_worker(
    nats_server: NatsServer, nc: Client, worker_nc: Client, how: str
) -> None:
    timeouts = NatsTimeouts(ttl=1, heartbeat=0.05, drain=2.0)
    engine = Firehose()
    async with serving(engine, worker_nc, timeouts) as worker:
        if how == "closes its stream":
            remote: RemoteEngine[Any, int] = RemoteEngine(
                nc, worker_id=worker.worker_id, codec=CODEC, timeouts=timeouts, window=4
            )
            async with open_stream(remote, make_context(None)) as stream:
                await anext(stream)
                await wait_until(lambda: worker.statistics().paused == 1)
        else:
            # A wire-3 client that reads nothing and goes away: the paused stream's
            # heartbeats find its inbox gone.
            crashing = await connect(nats_server)
            inbox = crashing.new_inbox()
            await crashing.subscribe(inbox)
            request = {"id": "r1", "data": None, "timeout": None, "metadata": {}}
            request |= {"wire": wire.WIRE_VERSION, "window": 4}
            await crashing.publish(worker.subject, CODEC.encode(request), reply=inbox)
            await wait_until(lambda: worker.statistics().paused == 1)
            await crashing.close()
        await wait_until(lambda: worker.statistics().in_flight == 0)
        assert worker.statistics().paused == 0
    assert engine.produced == 5  # four sent, one held back


# -- either side one wire version behind ------------------------------------------------------


async def raw_request(
    nc: Client, subject: str, request: dict[str, Any], frames: list[Any], done: anyio.Event
) -> str:
    """Publish ``request`` as a client would; decoded frames go to ``frames`` until END."""
    inbox = nc.new_inbox()

    async def on_msg(msg: Msg) -> None:
        frame = CODEC.decode(msg.data)
        frames.append(frame)
        if frame[1] in (wire.END, wire.ERR):
            done.set()

    await nc.subscribe(inbox, cb=on_msg)
    await settle(nc)
    await nc.publish(subject, CODEC.encode(request), reply=inbox)
    return inbox


async def test_a_wire_2_client_gets_no_flow_control_and_numbered_heartbeats(
    nc: Client, worker_nc: Client
) -> None:
    outputs = 1000

    async def then_quiet(ctx: Context[Any]) -> AsyncIterator[int]:
        async for item in Firehose(outputs).generate(ctx):
            yield item
        await anyio.sleep(0.2)  # a pause heartbeats fill

    timeouts = NatsTimeouts(ttl=1, heartbeat=0.02, drain=2.0)
    async with serving(FunctionEngine(then_quiet), worker_nc, timeouts) as worker:
        frames: list[Any] = []
        done = anyio.Event()
        request = {"id": "r1", "data": None, "timeout": None, "metadata": {}, "wire": 2}
        await raw_request(nc, worker.subject, request, frames, done)
        await done.wait()
        stats = worker.statistics()
    kinds = [kind for _, kind, _ in frames]
    assert [seq for seq, _, _ in frames] == list(range(len(frames)))  # heartbeats numbered
    assert wire.HB in kinds
    assert set(kinds) <= {wire.START, wire.DATA, wire.BATCH, wire.HB, wire.END}
    assert stats.outputs == outputs
    assert stats.pauses == 0


async def test_a_wire_3_worker_waits_for_the_credit_a_client_sends(
    nc: Client, worker_nc: Client
) -> None:
    async with serving(Firehose(30), worker_nc) as worker:
        frames: list[Any] = []
        done = anyio.Event()
        request = {"id": "r1", "data": None, "timeout": None, "metadata": {}}
        request |= {"wire": 3, "window": 10}
        inbox = await raw_request(nc, worker.subject, request, frames, done)
        for pauses, granted in ((1, 10), (2, 20)):
            await wait_until(lambda: worker.statistics().pauses == pauses)  # noqa: B023
            await wait_until(lambda: worker.statistics().paused == 1)
            assert worker.statistics().outputs == granted
            credit = wire.control_codec.encode([wire.CREDIT, granted + 10, inbox])
            await nc.publish(worker.control_subject, credit)
        await done.wait()
    assert worker.statistics().outputs == 30


async def test_a_client_reads_all_from_a_worker_that_ignores_its_window(
    nats_server: NatsServer, nc: Client
) -> None:
    # A worker one version behind: numbered heartbeats, no pause, CREDIT ignored.
    old = await connect(nats_server)
    outputs = 3 * wire.DEFAULT_WINDOW

    async def answer(msg: Msg) -> None:
        frames = [[0, wire.START, "old"], [1, wire.HB, None]]
        frames += [[2 + i, wire.DATA, i] for i in range(outputs)]
        frames.append([2 + outputs, wire.END, None])
        for frame in frames:
            await old.publish(msg.reply, CODEC.encode(frame))

    await old.subscribe("llm-pipeline.worker.old", cb=answer)
    await old.subscribe("llm-pipeline.control.old")  # takes the CREDIT messages, ignores them
    await settle(old)
    try:
        remote: RemoteEngine[Any, int] = RemoteEngine(nc, worker_id="old", codec=CODEC)
        assert [item async for item in remote.generate(make_context(None))] == list(range(outputs))
    finally:
        await old.close()
