"""The public test doubles are themselves tested: make_context, collect, ScriptedEngine and
worker_set (check_operator has its own files: test_check_operator*.py)."""

from __future__ import annotations

from contextlib import aclosing

import anyio
import pytest

from pipeline import RoundRobin, Router, StreamDisconnected
from pipeline.testing import ScriptedEngine, collect, make_context, worker_set

# -- make_context and collect -----------------------------------------------------------------


def test_make_context_builds_a_fresh_root_context() -> None:
    ctx = make_context([1, 2], id="r", metadata={"k": "v"})
    assert (ctx.data, ctx.id, dict(ctx.metadata)) == ([1, 2], "r", {"k": "v"})
    assert not ctx.is_stopped
    assert ctx.deadline is None
    assert make_context(None).id != make_context(None).id


def test_make_context_passes_a_deadline_through() -> None:
    assert make_context(None, deadline=12.5).deadline == 12.5


async def test_collect_returns_every_output_in_order() -> None:
    assert await collect(ScriptedEngine(range(5)), make_context(None)) == [0, 1, 2, 3, 4]


async def test_collect_keeps_what_arrived_before_a_kill() -> None:
    engine = ScriptedEngine(["a", "b"], then="hang")
    ctx = make_context(None)
    async with anyio.create_task_group() as tg:

        async def kill() -> None:
            await engine.hanging.wait()
            ctx.kill()

        tg.start_soon(kill)
        assert await collect(engine, ctx) == ["a", "b"]


# -- ScriptedEngine ---------------------------------------------------------------------------


async def test_scripted_engine_plays_its_script_for_every_request_and_records_them() -> None:
    engine = ScriptedEngine(["x", "y"])
    first, second = make_context(1), make_context(2)
    assert await collect(engine, first) == ["x", "y"]
    assert await collect(engine, second) == ["x", "y"]
    assert engine.requests == [first, second]
    assert engine.completed == 2
    assert engine.open_streams == 0
    assert not engine.closed_early


async def test_scripted_engine_outputs_may_depend_on_the_request() -> None:
    engine = ScriptedEngine(lambda ctx: range(ctx.data))
    assert await collect(engine, make_context(3)) == [0, 1, 2]
    assert await collect(engine, make_context(1)) == [0]


async def test_scripted_engine_raises_the_given_exception_after_its_outputs() -> None:
    error = StreamDisconnected("gone")
    engine = ScriptedEngine(["a"], then=error)
    got: list[str] = []
    with pytest.raises(StreamDisconnected) as info:
        async for item in engine.generate(make_context(None)):
            got.append(item)
    assert info.value is error
    assert got == ["a"]
    assert engine.open_streams == 0


async def test_scripted_engine_hang_waits_for_stop_and_then_ends_cleanly() -> None:
    engine = ScriptedEngine(["a"], then="hang")
    ctx = make_context(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, engine, ctx)
        await engine.hanging.wait()
        await anyio.wait_all_tasks_blocked()
        assert engine.open_streams == 1
        assert engine.completed == 0
        ctx.stop_generating()
    assert engine.completed == 1
    assert not engine.closed_early


async def test_scripted_engine_stops_before_the_next_output_when_asked() -> None:
    engine = ScriptedEngine(["a", "b", "c"])
    ctx = make_context(None)
    got: list[str] = []
    async for item in engine.generate(ctx):
        got.append(item)
        ctx.stop_generating()
    assert got == ["a"]
    assert not engine.closed_early


async def test_scripted_engine_records_an_early_close() -> None:
    engine = ScriptedEngine(["a", "b"])
    async with aclosing(engine.generate(make_context(None))) as stream:
        async for _ in stream:
            break
    assert engine.closed_early
    assert engine.open_streams == 0
    assert engine.completed == 0


async def test_scripted_engine_records_a_kill_as_an_early_close() -> None:
    engine: ScriptedEngine[str] = ScriptedEngine([], then="hang")
    ctx = make_context(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, engine, ctx)
        await engine.hanging.wait()
        ctx.kill()
    assert engine.closed_early
    assert engine.open_streams == 0


def test_scripted_engine_repr_counts_requests() -> None:
    assert repr(ScriptedEngine()) == "ScriptedEngine(requests=0)"


async def test_worker_set_of_scripted_engines_fails_over_in_order() -> None:
    dying = ScriptedEngine(["a"], then=StreamDisconnected("worker died"))
    healthy = ScriptedEngine(["b"])
    workers = worker_set(dying, healthy, name="decode")
    assert [w.id for w in workers.members] == ["worker-0", "worker-1"]
    assert workers.name == "decode"
    router = Router(workers, RoundRobin())
    with pytest.raises(StreamDisconnected):
        await collect(router, make_context("first"))
    assert await collect(router, make_context("second")) == ["b"]
    assert [len(dying.requests), len(healthy.requests)] == [1, 1]
