"""The public test doubles are themselves tested: make_context, collect, ScriptedEngine and
check_operator, which must accept good operators and reject each kind of bad one."""

from __future__ import annotations

import copy
import math
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
import pytest

from pipeline import (
    Context,
    Engine,
    EngineError,
    FunctionEngine,
    RoundRobin,
    Router,
    Stream,
    StreamDisconnected,
    link,
)
from pipeline import Operator as OperatorProtocol
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context, worker_set

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


# -- check_operator: good operators pass ------------------------------------------------------


class Upper:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx):
            yield item.upper()


class ViaChild:
    """Sends a child leg downstream, as Migration does."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx.child(ctx.data + "!")):
            yield item


class Tidy:
    """Closes downstream itself and runs a task group that finishes before the first yield."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        results: list[int] = []
        async with anyio.create_task_group() as tg:
            for n in range(3):
                tg.start_soon(_append, results, n)
        async with aclosing(downstream.generate(ctx.replace(ctx.data))) as stream:
            async for item in stream:
                yield f"{item}{len(results)}"


async def _append(results: list[int], n: int) -> None:
    await anyio.lowlevel.checkpoint()
    results.append(n)


class Buffering:
    """Yields nothing until downstream ends: the early-stop check must still terminate."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        items = [item async for item in downstream.generate(ctx)]
        for item in items:
            yield item


@pytest.mark.parametrize("factory", [Upper, ViaChild, Tidy, Buffering])
async def test_check_operator_accepts_well_behaved_operators(
    factory: Callable[[], OperatorProtocol[Any, Any, Any, Any]],
) -> None:
    await check_operator(factory, "req", ["a", "b", "c"])


async def test_check_operator_accepts_an_operator_with_no_downstream_outputs() -> None:
    await check_operator(Upper, "req", [])


async def test_the_custom_operator_example_holds() -> None:
    engine = ScriptedEngine(["a", "b"])
    assert await collect(link(Upper(), engine), make_context("req")) == ["A", "B"]
    await check_operator(Upper, "req", ["a", "b", "c"])


# -- check_operator: each kind of bad operator is rejected ------------------------------------


class NewContext:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(Context.new(ctx.data)):
            yield item


class SwallowsErrors:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        except Exception:
            return


class WrapsErrors:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        except Exception as exc:
            raise EngineError("downstream failed") from exc


class CopiesErrors:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        except Exception as exc:
            raise copy.copy(exc) from None


class KeepsGoingAfterKill:
    """Catches the cancellation from kill() and yields one more item."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        except anyio.get_cancelled_exc_class():
            yield "still going"


class EndsQuietlyAfterKill:
    """Catches the cancellation from kill() and ends the stream as if it were complete."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        except anyio.get_cancelled_exc_class():
            return


class HandsStreamToTask:
    """Iterates downstream in a task that outlives its consumer, passing items over a channel."""

    def __init__(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        send, receive = anyio.create_memory_object_stream[str](math.inf)

        async def pump() -> None:
            with send:
                async for item in downstream.generate(ctx):
                    try:
                        send.send_nowait(item)
                    except anyio.BrokenResourceError:
                        return

        self._tg.start_soon(pump)
        with receive:
            async for item in receive:
                yield item


class LeavesTask:
    """A pass-through that starts a background task and never ends it."""

    def __init__(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        self._tg.start_soon(anyio.sleep_forever)
        async for item in downstream.generate(ctx):
            yield item


class NeverCallsDownstream:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        yield "made up"


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        pytest.param(NewContext, "downstream saw context id", id="new-context"),
        pytest.param(SwallowsErrors, "swallowed the downstream error", id="swallows"),
        pytest.param(WrapsErrors, "turned the downstream error .* into EngineError", id="wraps"),
        pytest.param(CopiesErrors, "re-raised a copy", id="copies"),
        pytest.param(KeepsGoingAfterKill, "yielded 'still going' after kill", id="keeps-going"),
        pytest.param(EndsQuietlyAfterKill, "swallowed the cancellation", id="ends-quietly"),
        pytest.param(NeverCallsDownstream, "never called downstream", id="no-downstream"),
    ],
)
async def test_check_operator_rejects_a_bad_operator_naming_the_rule(
    factory: Callable[[], OperatorProtocol[Any, Any, Any, Any]], message: str
) -> None:
    with pytest.raises(AssertionError, match=f"^{factory.__name__}: {message}"):
        await check_operator(factory, "req", ["a", "b", "c"])


@pytest.mark.parametrize(
    ("operator", "message"),
    [
        pytest.param(HandsStreamToTask, "downstream stream .* another task", id="hands-off"),
        pytest.param(LeavesTask, r"left \d+ task\(s\) running", id="leftover-task"),
    ],
)
async def test_check_operator_rejects_an_operator_that_leaves_work_in_other_tasks(
    operator: Callable[[anyio.abc.TaskGroup], OperatorProtocol[Any, Any, Any, Any]],
    message: str,
) -> None:
    async with anyio.create_task_group() as tg:
        with pytest.raises(AssertionError, match=message):
            await check_operator(lambda: operator(tg), "req", ["a", "b", "c"])
        tg.cancel_scope.cancel()


async def test_check_operator_gives_up_on_an_operator_that_hangs() -> None:
    class Hangs:
        async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.2)
            async for item in downstream.generate(ctx):
                yield item

    with pytest.raises(TimeoutError):
        await check_operator(Hangs, "req", ["a"], time_limit=0.1)


async def test_an_operator_passing_check_operator_works_on_a_function_engine() -> None:
    # check_operator drives the operator through link() and a ScriptedEngine; the same
    # operator in front of a FunctionEngine behaves the same way.
    async def source(ctx: Context[str]) -> AsyncIterator[str]:
        yield ctx.data

    await check_operator(Upper, "hi", ["hi"])
    assert await collect(link(Upper(), FunctionEngine(source)), make_context("hi")) == ["HI"]


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
