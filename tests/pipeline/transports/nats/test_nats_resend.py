"""Frames lost without an outage the worker parked for are sent again (issue 35).

A worker keeps each frame of a flow-controlled stream until its client acknowledges it,
and parks every stream through an outage it sees, resuming where the client's ping says.
These are the losses it did not see: a frame gone with no outage at all (as a dead
socket takes it), a connection lost and back between two rounds of its heartbeat loop,
and a client that is not back yet when the worker, just reconnected, sends again. Real
nats-server; the faults are a publish that loses a frame and a TCP forwarder
(``tcp_proxy.py`` beside it) that cuts one client's connection, drops its bytes or
holds it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

import nats
import nats.errors
from nats.aio.client import Client

from pipeline import Context, FunctionEngine, open_stream
from pipeline.testing import make_context
from pipeline.transports.codec import MsgpackCodec
from pipeline.transports.nats import NatsTimeouts, RemoteEngine, serve, wire
from tests.helpers.nats_server import NatsServer
from tests.pipeline.transports.nats.tcp_proxy import Proxy

pytestmark = pytest.mark.slow  # every test starts a nats-server

CODEC = MsgpackCodec()
#: no heartbeats: the client's idle ping is the only thing that brings lost frames back
QUIET = NatsTimeouts(ttl=1, heartbeat=60.0, drain=2.0)


async def a_real_wait() -> None:
    """Suspend on a future: each output then travels alone (no batch)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.call_soon(future.set_result, None)
    await future


def scripted(*steps: str | anyio.Event) -> FunctionEngine[Any, str]:
    """An engine yielding each string of ``steps`` alone and waiting at each event."""

    async def generate(ctx: Context[Any]) -> AsyncIterator[str]:
        for step in steps:
            if isinstance(step, anyio.Event):
                await step.wait()
            else:
                await a_real_wait()
                yield step

    return FunctionEngine(generate)


async def wait_until(condition: Callable[[], bool], within: float = 5.0) -> None:
    """Poll ``condition`` (about another connection's state) until it holds."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - no event spans another client's socket
            await anyio.sleep(0.005)


@asynccontextmanager
async def via(proxy: Proxy) -> AsyncIterator[Client]:
    """A connection through ``proxy`` that reconnects quickly, closed on the way out."""
    nc = await nats.connect(proxy.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1)
    try:
        yield nc
    finally:
        await nc.close()


async def test_a_frame_lost_while_the_stream_was_not_parked_is_sent_again(
    nc: Client, worker_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once, such a stream stalled for good: its client pinged, saying which frame it
    # expected, the worker answered "known" and sent nothing, and the stream waited.
    release = anyio.Event()
    lost: list[int] = []
    publish = worker_nc.publish

    async def losing(subject: str, payload: bytes = b"", **options: Any) -> None:
        try:
            frame = CODEC.decode(payload) if payload else None
        except ValueError:
            frame = None
        if not lost and isinstance(frame, list) and frame[1:] == [wire.DATA, "c"]:
            lost.append(frame[0])  # gone with a connection nobody saw die
            return
        await publish(subject, payload, **options)

    monkeypatch.setattr(worker_nc, "publish", losing)
    engine = scripted("a", "b", "c", release, "d")
    async with serve(
        engine, nc=worker_nc, model="m", codec=CODEC, timeouts=QUIET, register=False
    ) as worker:
        client_timeouts = NatsTimeouts(idle=0.2)
        remote: RemoteEngine[Any, str] = RemoteEngine(
            nc, worker_id=worker.worker_id, codec=CODEC, timeouts=client_timeouts
        )
        async with open_stream(remote, make_context(None)) as stream:
            assert [await anext(stream), await anext(stream)] == ["a", "b"]
            with anyio.fail_after(5):  # the client pings when quiet: "c" comes again
                assert await anext(stream) == "c"
            release.set()
            assert [item async for item in stream] == ["d"]
    assert lost == [3]  # START, a, b, then c was lost


@asynccontextmanager
async def proxied(nats_server: NatsServer, count: int) -> AsyncIterator[list[Proxy]]:
    """``count`` forwarders to the server, running for the block."""
    proxies = [Proxy(nats_server.port or 0) for _ in range(count)]
    async with anyio.create_task_group() as tg:
        for proxy in proxies:
            await tg.start(proxy.run)
        yield proxies
        tg.cancel_scope.cancel()


@pytest.mark.time_limit(30)
async def test_frames_lost_with_a_connection_lost_and_back_between_two_rounds_are_sent_again(
    nats_server: NatsServer, nc: Client
) -> None:
    # The worker's connection dies with a frame in it, unnoticed, and is back before its
    # heartbeat loop looked: never seen down, the stream was not parked, and its
    # heartbeats (which keep a quiet client from pinging) would come back as if nothing
    # was lost. Back since the last round counts as down: parked, resumed at the ping.
    more, release = anyio.Event(), anyio.Event()
    # Rounds far apart next to the few milliseconds the connection is away (a round
    # that happens to see it down parks the stream the old way), and beats closer than
    # the client's idle ping, so that a quiet stream's client never pings unless parked.
    timeouts = NatsTimeouts(ttl=1, heartbeat=0.5, drain=2.0)
    engine = scripted("a", more, "b", release, "c")
    async with (
        proxied(nats_server, 1) as (proxy,),
        via(proxy) as worker_nc,
        serve(
            engine, nc=worker_nc, model="m", codec=CODEC, timeouts=timeouts, register=False
        ) as worker,
    ):
        remote: RemoteEngine[Any, str] = RemoteEngine(
            nc, worker_id=worker.worker_id, codec=CODEC, timeouts=NatsTimeouts(idle=1.5)
        )
        async with open_stream(remote, make_context(None)) as stream:
            assert await anext(stream) == "a"
            proxy.blackhole = True  # what the worker sends from now on is lost
            more.set()
            await wait_until(lambda: worker.statistics().outputs == 2)  # "b": lost
            proxy.cut()
            proxy.blackhole = False
            await wait_until(lambda: worker_nc.stats["reconnects"] == 1)
            with anyio.fail_after(10):
                assert await anext(stream) == "b"
            release.set()
            assert [item async for item in stream] == ["c"]


@pytest.mark.time_limit(30)
async def test_a_worker_back_before_its_client_holds_the_stream_for_it(
    nats_server: NatsServer,
) -> None:
    # Both lose the bus; the worker is back first and sends what its engine produced:
    # nobody listens on the client's inbox yet ("no responders"), which once meant the
    # client was gone for good, and the stream was cut off. Just after its own
    # reconnection the worker holds the stream instead, until the client's ping.
    go = anyio.Event()
    engine = scripted("a", go, *"bcdefgh")
    async with (
        proxied(nats_server, 2) as (to_client, to_worker),
        via(to_client) as nc,
        via(to_worker) as worker_nc,
        serve(
            engine, nc=worker_nc, model="m", codec=CODEC, timeouts=QUIET, register=False
        ) as worker,
    ):
        remote: RemoteEngine[Any, str] = RemoteEngine(nc, worker_id=worker.worker_id, codec=CODEC)
        probe = await nc.subscribe("probe")  # (gone from the server with the client's)
        async with open_stream(remote, make_context(None)) as stream:
            assert await anext(stream) == "a"
            to_client.hold()
            to_client.cut()  # the client is kept away
            await gone(worker_nc, "probe")
            to_worker.cut()  # the worker is back at once
            await wait_until(lambda: worker_nc.stats["reconnects"] == 1 and worker_nc.is_connected)
            go.set()  # what it sends now reaches no subscriber
            await wait_until(lambda: worker.statistics().outputs >= 2)
            to_client.release()  # the client comes back, and pings
            with anyio.fail_after(10):
                assert [item async for item in stream] == list("bcdefgh")
        await probe.unsubscribe()


async def gone(nc: Client, subject: str) -> None:
    """Wait until the server no longer has a subscriber on ``subject`` (it noticed that
    the client that had one lost its connection: until then, it would still deliver to
    it, and the frames would be lost without a word)."""
    with anyio.fail_after(5):
        while True:
            try:
                await nc.request(subject, b"", timeout=0.2)
            except nats.errors.NoRespondersError:
                return
            except nats.errors.TimeoutError:
                pass
