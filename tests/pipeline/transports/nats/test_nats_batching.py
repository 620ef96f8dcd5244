"""Batched frames over a real nats-server: ready outputs share a message, waits flush.

The worker's statistics count the messages it published, so a test sees how outputs were
grouped without timing anything. Where a test needs the grouping to be exact it lifts the
hold-time bound (``MAX_HOLD``), so that only the engine's waits and ``MAX_BATCH`` cut
batches, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from nats.aio.client import Client

from operators.contracts.llm import EngineOutput
from operators.contracts.transport import llm_codec
from pipeline import Context, EngineError, FunctionEngine, Stream, open_stream
from pipeline.testing import make_context
from pipeline.transports.codec import Codec, MsgpackCodec
from pipeline.transports.nats import NatsTimeouts, NatsWorker, RemoteEngine, serve, serving, wire

pytestmark = pytest.mark.slow  # every test starts a nats-server

#: no heartbeats within a test, so that every message counted is one the stream needed
QUIET = NatsTimeouts(ttl=1, heartbeat=60.0, drain=2.0)


@contextmanager
def bounds(*, max_batch: int | None = None, max_hold: float = math.inf) -> Iterator[None]:
    """Set the worker's batch bounds for the block (by default: no hold-time bound)."""
    saved = serving.MAX_BATCH, serving.MAX_HOLD
    serving.MAX_BATCH = saved[0] if max_batch is None else max_batch
    serving.MAX_HOLD = max_hold
    try:
        yield
    finally:
        serving.MAX_BATCH, serving.MAX_HOLD = saved


@asynccontextmanager
async def pair(
    engine: Any, nc: Client, worker_nc: Client, codec: Codec | None = None
) -> AsyncIterator[tuple[NatsWorker[Any, Any], RemoteEngine[Any, Any]]]:
    """A worker serving ``engine`` (no discovery) and a RemoteEngine routed to it."""
    codec = codec if codec is not None else MsgpackCodec()
    async with serve(
        engine, nc=worker_nc, model="m", codec=codec, timeouts=QUIET, register=False
    ) as worker:
        yield worker, RemoteEngine(nc, worker_id=worker.worker_id, codec=codec, timeouts=QUIET)


async def outcome(engine: Any, ctx: Context[Any]) -> tuple[list[Any], BaseException | None]:
    """The items a stream gave, and the exception it ended with (or None)."""
    items: list[Any] = []
    try:
        async with open_stream(engine, ctx) as stream:
            async for item in stream:
                items.append(item)
    except Exception as exc:
        return items, exc
    return items, None


async def a_real_wait() -> None:
    """Suspend on a future (not a bare checkpoint): what an engine waiting for work does."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.call_soon(future.set_result, None)
    await future


def burst(outputs: list[Any], then: Exception | None = None) -> FunctionEngine[Any, Any]:
    """An engine whose outputs are all ready at once (a checkpoint between them, no wait)."""

    async def generate(ctx: Context[Any]) -> Stream[Any]:
        for output in outputs:
            await checkpoint()
            yield output
        if then is not None:
            raise then

    return FunctionEngine(generate)


async def test_ready_outputs_share_a_message(nc: Client, worker_nc: Client) -> None:
    with bounds():
        async with pair(burst(list(range(10))), nc, worker_nc) as (worker, remote):
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    assert (items, error) == (list(range(10)), None)
    # START, the first output alone (never held), the nine others together, END
    assert (stats.messages, stats.outputs) == (4, 10)


async def test_a_message_carries_at_most_max_batch_outputs(nc: Client, worker_nc: Client) -> None:
    with bounds():
        async with pair(burst(list(range(70))), nc, worker_nc) as (worker, remote):
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    assert (items, error) == (list(range(70)), None)
    assert serving.MAX_BATCH == 32
    # START, 1, 32, 32, 5, END
    assert (stats.messages, stats.outputs) == (6, 70)


async def test_an_engine_that_waits_gets_each_token_sent_at_once(
    nc: Client, worker_nc: Client
) -> None:
    # The engine produces token i+1 only after the client has token i: a worker that held
    # a token back for the next one would never get it (and the test would time out).
    delivered = [anyio.Event() for _ in range(6)]

    async def paced(ctx: Context[Any]) -> AsyncIterator[int]:
        for token in range(6):
            if token:
                await delivered[token - 1].wait()
            yield token

    with bounds():
        async with pair(FunctionEngine(paced), nc, worker_nc) as (worker, remote):
            ctx = make_context(None)
            items = []
            async with open_stream(remote, ctx) as stream:
                async for item in stream:
                    items.append(item)
                    delivered[item].set()
            stats = worker.statistics()
    assert items == list(range(6))
    assert (stats.messages, stats.outputs) == (6 + 2, 6)  # one per token, START and END


async def test_an_error_after_a_batch_arrives_after_its_outputs(
    nc: Client, worker_nc: Client
) -> None:
    engine = burst(list(range(5)), then=EngineError("boom"))
    with bounds():
        async with pair(engine, nc, worker_nc) as (worker, remote):
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    assert items == list(range(5))
    assert isinstance(error, EngineError)
    assert "boom" in str(error)
    assert stats.messages == 4  # START, DATA, BATCH of four, ERR


async def test_an_unencodable_output_fails_the_stream_after_the_ones_before_it(
    nc: Client, worker_nc: Client
) -> None:
    with bounds():
        async with pair(burst([0, 1, 2, {3}, 4]), nc, worker_nc) as (worker, remote):
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    assert items == [0, 1, 2]
    assert isinstance(error, EngineError)
    assert "cannot encode a set output" in str(error)
    assert stats.messages == 4  # START, DATA, BATCH of 1 and 2, ERR


def endless(closed: anyio.Event) -> FunctionEngine[Any, int]:
    """An engine that is always ready, until it is stopped or killed; ``closed`` at the end."""

    async def generate(ctx: Context[Any]) -> Stream[int]:
        try:
            for token in range(10**9):
                await checkpoint()
                if ctx.is_stopped:
                    return
                yield token
        finally:
            closed.set()

    return FunctionEngine(generate)


async def test_a_kill_during_a_batch_reaches_the_engine_and_drops_the_batch(
    nc: Client, worker_nc: Client
) -> None:
    closed = anyio.Event()
    with bounds(max_batch=10**9):
        async with pair(endless(closed), nc, worker_nc) as (worker, remote):
            # A window the engine cannot fill before the kill arrives (at the window the
            # worker would flush what it holds and pause, which is right, but not this test).
            remote = RemoteEngine(nc, worker_id=worker.worker_id, timeouts=QUIET, window=10**8)
            ctx = make_context(None)
            async with open_stream(remote, ctx) as stream:
                assert await stream.__anext__() == 0
                ctx.kill()  # everything after output 0 is being held now
            await closed.wait()
            stats = worker.statistics()
    assert stats.clients_gone == 1
    assert stats.pauses == 0
    assert stats.messages == 2  # START and the first output: the held batch was dropped


async def test_a_stop_during_a_batch_ends_cleanly_with_nothing_more(
    nc: Client, worker_nc: Client
) -> None:
    """The worker flushes what it held and ends; the client, asked to stop, yields none of it
    (as a local engine yields nothing after its stop) and the stream ends without a kill."""
    closed = anyio.Event()
    with bounds(max_batch=10**9):
        async with pair(endless(closed), nc, worker_nc) as (worker, remote):
            ctx = make_context(None)
            items = []
            async with open_stream(remote, ctx) as stream:
                async for item in stream:
                    items.append(item)
                    if item == 0:
                        ctx.stop_generating()
            stats = worker.statistics()
    assert items == [0]
    assert stats.outputs >= 1
    assert stats.clients_gone == 0  # a clean END, not a client that went away


async def test_a_wire_1_client_gets_one_message_per_output(nc: Client, worker_nc: Client) -> None:
    codec = MsgpackCodec()
    with bounds():
        async with pair(burst(list(range(5))), nc, worker_nc) as (worker, _):
            frames: list[Any] = []
            ended = anyio.Event()

            async def on_msg(msg: Any) -> None:
                frames.append(codec.decode(msg.data))
                if frames[-1][1] in (wire.END, wire.ERR):
                    ended.set()

            inbox = nc.new_inbox()
            subscription = await nc.subscribe(inbox, cb=on_msg)
            request = {"id": "old", "data": None, "timeout": None, "metadata": {}}  # no "wire"
            await nc.publish(worker.subject, codec.encode(request), reply=inbox)
            await ended.wait()
            await subscription.unsubscribe()
    kinds = [kind for _, kind, _ in frames]
    assert kinds == [wire.START] + [wire.DATA] * 5 + [wire.END]
    assert [body for _, kind, body in frames if kind == wire.DATA] == list(range(5))
    assert [seq for seq, _, _ in frames] == list(range(7))


outputs = st.builds(
    EngineOutput,
    token_ids=st.lists(st.integers(0, 2**17), min_size=1, max_size=3),
    finish_reason=st.sampled_from([None, "stop", "length"]),
    index=st.integers(0, 2),
    text=st.none() | st.text(max_size=3),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(groups=st.lists(st.lists(outputs, max_size=8), min_size=1, max_size=6),
       max_batch=st.integers(2, 5))  # fmt: skip
async def test_any_grouping_into_batches_gives_the_same_items(
    nc: Client, worker_nc: Client, groups: list[list[EngineOutput]], max_batch: int
) -> None:
    """Outputs ready together (a group) are batched, a wait between groups flushes: the
    client sees the same outputs, and the worker sent exactly the messages the rule says."""

    async def grouped(ctx: Context[Any]) -> AsyncIterator[EngineOutput]:
        for index, group in enumerate(groups):
            if index:
                await a_real_wait()
            for output in group:
                await checkpoint()
                yield output

    with bounds(max_batch=max_batch):
        async with pair(FunctionEngine(grouped), nc, worker_nc, llm_codec()) as (worker, remote):
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    flat = [output for group in groups for output in group]
    assert (items, error) == (flat, None)
    # The first output goes alone; then each group's held outputs, MAX_BATCH at a time.
    sizes = [len(group) for group in groups]
    if flat:
        first = next(i for i, size in enumerate(sizes) if size)
        sizes[first] -= 1
    expected = 2 + bool(flat) + sum(math.ceil(size / max_batch) for size in sizes)
    assert (stats.messages, stats.outputs) == (expected, len(flat))


async def test_a_batch_over_the_payload_limit_is_split(
    nc: Client, worker_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nats-py enforces the server's max_payload (from its INFO) before sending: lower it.
    monkeypatch.setattr(worker_nc, "_max_payload", 1000)
    texts = [f"{i:03}" * 50 for i in range(10)]  # 150 bytes each: 6 fit in one message
    with bounds():
        async with pair(burst([*texts, "x" * 2000]), nc, worker_nc) as (worker, remote):
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    assert items == texts
    assert isinstance(error, EngineError)
    assert "over the NATS limit" in str(error)
    assert stats.outputs == 10
    assert 4 < stats.messages < 2 + 10  # split, but still batched


async def test_a_merged_batch_over_the_payload_limit_is_split_before_merging(
    nc: Client, worker_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_nc, "_max_payload", 1000)
    texts = [f"{i:03}" * 50 for i in range(11)]  # the first alone, then 10: 1500 bytes merged
    codec = MsgpackCodec()
    with bounds():
        async with serve(
            burst(texts),
            nc=worker_nc,
            model="m",
            codec=codec,
            timeouts=QUIET,
            register=False,
            coalesce=lambda items: ["".join(items)],
        ) as worker:
            remote: RemoteEngine[Any, Any] = RemoteEngine(
                nc, worker_id=worker.worker_id, codec=codec, timeouts=QUIET
            )
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    assert error is None
    # Halves of the engine's outputs, each merged: 750 bytes fit.
    assert items == [texts[0], "".join(texts[1:6]), "".join(texts[6:])]
    assert (stats.messages, stats.outputs) == (5, 11)


def joined(items: list[list[int]]) -> list[int]:
    return [i for item in items for i in item]


@pytest.mark.parametrize("where", ["worker", "client"])
async def test_coalesced_batches_are_one_item_each_and_credit_counts_every_output(
    nc: Client, worker_nc: Client, where: str
) -> None:
    # ``coalesce`` merges a batch's outputs (the LLM layer: token outputs into bursts). A
    # worker given it merges before sending (wire 4, the frame says how many outputs it
    # holds); a client given it merges what a worker that does not sends. Flow control
    # counts the engine's outputs either way: a window smaller than the stream neither
    # stalls it nor lets the worker run further ahead.
    batches: list[list[list[int]]] = []

    def coalesce(items: list[Any]) -> list[Any]:
        batches.append(list(items))
        return [joined(items)]

    codec = MsgpackCodec()
    with bounds(max_batch=8):
        async with serve(
            burst([[i] for i in range(100)]),
            nc=worker_nc,
            model="m",
            codec=codec,
            timeouts=QUIET,
            register=False,
            coalesce=coalesce if where == "worker" else None,
        ) as worker:
            remote: RemoteEngine[Any, Any] = RemoteEngine(
                nc,
                worker_id=worker.worker_id,
                codec=codec,
                timeouts=QUIET,
                window=16,
                coalesce=coalesce if where == "client" else None,
            )
            items, error = await outcome(remote, make_context(None))
            stats = worker.statistics()
    assert error is None
    assert joined(items) == list(range(100))
    # Each BATCH is one item; a DATA frame (the first output, an output alone) another.
    assert [item for item in items if len(item) > 1] == [joined(batch) for batch in batches]
    assert all(1 < len(batch) <= 8 for batch in batches)
    assert len(items) < 50
    assert stats.outputs == 100
    assert stats.pauses >= 1  # the window (16) held the worker back, and credit came


async def test_a_client_one_version_behind_gets_its_batches_unmerged(
    nc: Client, worker_nc: Client
) -> None:
    # A wire-3 client reads three-element frames only: a merging worker sends it the
    # outputs as the engine gave them.
    def coalesce(items: list[Any]) -> list[Any]:
        return [joined(items)]

    codec = MsgpackCodec()
    with bounds():
        async with serve(
            burst([[i] for i in range(10)]),
            nc=worker_nc,
            model="m",
            codec=codec,
            timeouts=QUIET,
            register=False,
            coalesce=coalesce,
        ) as worker:
            inbox = nc.new_inbox()
            subscription = await nc.subscribe(inbox)
            request = {"id": "r", "data": None, "timeout": None, "metadata": {}}
            await nc.publish(worker.subject, codec.encode(request | {"wire": 3}), reply=inbox)
            frames = []
            while not frames or frames[-1][1] != wire.END:
                frames.append(codec.decode((await subscription.next_msg(timeout=5)).data))
            await subscription.unsubscribe()
    assert all(len(frame) == 3 for frame in frames)
    assert [frame[1] for frame in frames] == [wire.START, wire.DATA, wire.BATCH, wire.END]
    assert frames[2][2] == [[i] for i in range(1, 10)]
