"""open_stream and FunctionEngine: kill, stop_generating, deadlines, and what passes through."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

from pipeline import Context, Engine, EngineError, FunctionEngine, Stream, link, open_stream
from pipeline.testing import ScriptedEngine, collect, make_context


class PassThrough:
    async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
        async for item in downstream.generate(ctx):
            yield item


class BlockingEngine:
    """Yields ``first``, then blocks until cancelled; only a cancellation can end it."""

    def __init__(self, first: str = "first") -> None:
        self.first = first
        self.blocked = anyio.Event()
        self.cancelled = False

    async def generate(self, ctx: Context[Any], /) -> Stream[str]:
        yield self.first
        self.blocked.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        yield "unreachable"  # pragma: no cover


async def test_open_stream_streams_every_item() -> None:
    async def count(ctx: Context[int]) -> AsyncIterator[int]:
        for i in range(ctx.data):
            yield i

    async with open_stream(FunctionEngine(count), make_context(3)) as stream:
        assert [item async for item in stream] == [0, 1, 2]


def test_function_engine_repr_names_the_function() -> None:
    async def my_engine(ctx: Context[int]) -> AsyncIterator[int]:
        yield 1

    assert "my_engine" in repr(FunctionEngine(my_engine))


# -- kill -------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 1, 3])
async def test_kill_cancels_a_stream_blocked_inside_the_engine(depth: int) -> None:
    engine = BlockingEngine()
    ctx = make_context(None)
    received: list[str] = []
    finished_loop = False
    async with anyio.create_task_group() as tg:

        async def kill_when_blocked() -> None:
            await engine.blocked.wait()
            ctx.kill()

        tg.start_soon(kill_when_blocked)
        with anyio.fail_after(2):
            async with open_stream(link(*[PassThrough()] * depth, engine), ctx) as stream:
                async for item in stream:
                    received.append(item)
                finished_loop = True
    assert received == ["first"]
    assert engine.cancelled
    assert ctx.is_killed
    assert not finished_loop


async def test_kill_cancels_a_stream_blocked_inside_an_operator() -> None:
    blocked = anyio.Event()

    class Stall:
        async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
            async for item in downstream.generate(ctx):
                yield item
                blocked.set()
                await anyio.sleep_forever()

    engine = ScriptedEngine(["a", "b"])
    ctx = make_context(None)
    async with anyio.create_task_group() as tg:

        async def kill() -> None:
            await blocked.wait()
            ctx.kill()

        tg.start_soon(kill)
        assert await collect(link(Stall(), engine), ctx) == ["a"]
    assert engine.closed_early
    assert engine.open_streams == 0


async def test_kill_cancels_the_consumer_blocked_outside_the_stream() -> None:
    ctx = make_context(None)
    reached_end = False
    async with anyio.create_task_group() as tg:
        async with open_stream(ScriptedEngine(["a"]), ctx) as stream:
            async for _ in stream:
                tg.start_soon(lambda: _kill_after_blocked(ctx))
                await anyio.sleep_forever()
            reached_end = True
    assert ctx.is_killed
    assert not reached_end


async def _kill_after_blocked(ctx: Context[Any]) -> None:
    await anyio.wait_all_tasks_blocked()
    ctx.kill()


async def test_kill_cancels_even_when_the_engine_waits_on_a_childs_stop() -> None:
    # kill() also stops the children; the stream must still end by cancellation, not by
    # the engine waking up to a graceful stop and finishing normally.
    class ViaChild:
        async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
            async for item in downstream.generate(ctx.child(ctx.data)):
                yield item

    engine = ScriptedEngine(["a"], then="hang")
    ctx = make_context(None)
    finished_loop = False
    async with anyio.create_task_group() as tg:

        async def kill() -> None:
            await engine.hanging.wait()
            ctx.kill()

        tg.start_soon(kill)
        async with open_stream(link(ViaChild(), engine), ctx) as stream:
            async for _ in stream:
                pass
            finished_loop = True
    assert not finished_loop
    assert engine.closed_early
    assert engine.completed == 0


async def test_a_context_killed_before_the_stream_opens_gets_nothing() -> None:
    engine = ScriptedEngine(["a", "b"])
    ctx = make_context(None)
    ctx.kill()
    assert await collect(engine, ctx) == []
    assert engine.open_streams == 0


async def test_killing_one_request_leaves_a_concurrent_one_alone() -> None:
    engine = ScriptedEngine(["a", "b"], then="hang")
    doomed, survivor = make_context(1), make_context(2)
    results: dict[int, list[str]] = {}

    async def run(ctx: Context[int]) -> None:
        results[ctx.data] = await collect(engine, ctx)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, doomed)
        tg.start_soon(run, survivor)
        await anyio.wait_all_tasks_blocked()
        doomed.kill()
        await anyio.wait_all_tasks_blocked()
        assert not survivor.is_stopped
        assert engine.open_streams == 1
        survivor.stop_generating()
    assert results == {1: ["a", "b"], 2: ["a", "b"]}
    assert engine.completed == 1


async def test_a_parent_kill_cancels_a_child_leg_streaming_in_another_task() -> None:
    parent = make_context("p")
    child = parent.child("leg")
    engine = BlockingEngine()
    legs: list[list[str]] = []

    async def leg() -> None:
        legs.append(await collect(engine, child))

    async with anyio.create_task_group() as tg:
        tg.start_soon(leg)
        await engine.blocked.wait()
        parent.kill()
    assert legs == [["first"]]
    assert engine.cancelled
    assert child.is_killed


async def test_a_child_leg_killed_leaves_the_parents_stream_running() -> None:
    parent = make_context("p")
    child = parent.child("leg")
    leg_engine = BlockingEngine()
    main_engine = ScriptedEngine(["x", "y"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, leg_engine, child)
        await leg_engine.blocked.wait()
        child.kill()
        assert await collect(main_engine, parent) == ["x", "y"]
    assert leg_engine.cancelled
    assert not parent.is_stopped


# -- stop_generating --------------------------------------------------------------------------


async def test_stop_generating_lets_the_engine_finish_cleanly() -> None:
    async def engine(ctx: Context[Any]) -> AsyncIterator[str]:
        yield "a"
        await ctx.wait_stopped()
        yield "flushed after stop"

    ctx = make_context(None)
    received: list[str] = []
    finished_loop = False
    async with open_stream(FunctionEngine(engine), ctx) as stream:
        async for item in stream:
            received.append(item)
            ctx.stop_generating()
        finished_loop = True
    assert received == ["a", "flushed after stop"]
    assert finished_loop
    assert not ctx.is_killed


async def test_stop_generating_from_another_task_ends_a_hanging_engine_cleanly() -> None:
    engine = ScriptedEngine(["a"], then="hang")
    ctx = make_context(None)
    async with anyio.create_task_group() as tg:

        async def stop() -> None:
            await engine.hanging.wait()
            ctx.stop_generating()

        tg.start_soon(stop)
        assert await collect(link(PassThrough(), engine), ctx) == ["a"]
    assert engine.completed == 1
    assert not engine.closed_early
    assert not ctx.is_killed


# -- deadlines --------------------------------------------------------------------------------


async def test_a_passing_deadline_kills_the_request_and_its_children() -> None:
    engine = BlockingEngine()
    ctx = make_context(None, timeout=0.05)
    child = ctx.child(None)
    with anyio.fail_after(2):
        assert await collect(link(PassThrough(), engine), ctx) == ["first"]
    assert engine.cancelled
    assert ctx.is_killed
    assert child.is_killed


async def test_a_deadline_already_passed_kills_at_once() -> None:
    engine = ScriptedEngine(["a"])
    ctx = make_context(None, deadline=anyio.current_time() - 1)
    assert await collect(engine, ctx) == []
    assert ctx.is_killed


async def test_a_childs_deadline_kills_the_child_and_not_the_parent() -> None:
    parent = make_context(None)
    child = parent.child(None, deadline=anyio.current_time() + 0.05)
    with anyio.fail_after(2):
        assert await collect(BlockingEngine(), child) == ["first"]
    assert child.is_killed
    assert not parent.is_stopped


async def test_a_parents_deadline_bounds_its_childrens_streams() -> None:
    parent = make_context(None, timeout=0.05)
    child = parent.child(None)
    with anyio.fail_after(2):
        await collect(BlockingEngine(), child)
    assert child.is_killed


# -- what open_stream does not absorb ---------------------------------------------------------


async def test_an_outer_cancellation_propagates_and_is_not_a_kill() -> None:
    ctx = make_context(None)
    engine = BlockingEngine()
    reached_after_block = False
    with anyio.CancelScope() as outer:
        async with open_stream(engine, ctx) as stream:
            async for _ in stream:
                outer.cancel()
                await checkpoint()
        reached_after_block = True
    assert outer.cancelled_caught
    assert not reached_after_block
    assert not ctx.is_killed


async def test_an_outer_timeout_is_not_swallowed() -> None:
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await collect(BlockingEngine(), make_context(None))


async def test_engine_errors_propagate_unchanged_and_the_stream_is_closed() -> None:
    error = EngineError("out of memory", request_id="r")
    engine = ScriptedEngine(["a"], then=error)
    with pytest.raises(EngineError) as info:
        await collect(link(PassThrough(), engine), make_context(None))
    assert info.value is error
    assert engine.open_streams == 0


async def test_consumer_errors_propagate_unchanged_and_close_the_stream() -> None:
    engine = ScriptedEngine(["a", "b"], then="hang")
    with pytest.raises(KeyError, match="consumer"):
        async with open_stream(link(PassThrough(), engine), make_context(None)) as stream:
            async for _ in stream:
                raise KeyError("consumer")
    assert engine.closed_early
    assert engine.open_streams == 0
