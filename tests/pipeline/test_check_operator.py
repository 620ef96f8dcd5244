"""check_operator accepts good operators and rejects each kind of bad one, naming the rule
it broke; no check can hang on the suite's own downstream, and checks are isolated."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Context, Engine, EngineError, FunctionEngine, Stream, link
from pipeline import Operator as OperatorProtocol
from pipeline.testing import (
    CheckTimeout,
    ConformanceError,
    ScriptedEngine,
    check_operator,
    collect,
    make_context,
)

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


async def test_an_operator_passing_check_operator_works_on_a_function_engine() -> None:
    # check_operator drives the operator through link() and a ScriptedEngine; the same
    # operator in front of a FunctionEngine behaves the same way.
    async def source(ctx: Context[str]) -> Stream[str]:
        yield ctx.data

    await check_operator(Upper, "hi", ["hi"])
    assert await collect(link(Upper(), FunctionEngine(source)), make_context("hi")) == ["HI"]


# -- the broken operators of issue 14: each named, none hangs, checks stay isolated ----------


class CatchesBaseException:
    """Catches everything, GeneratorExit and cancellation included, and yields a fallback."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        except BaseException:
            yield "fallback"


class RetriesForeverOnClose:
    """Treats every exception, GeneratorExit included, as a reason to call downstream again.

    "Forever" within reason: a thousand times, far more than the check ever sees. A truly
    endless loop would spin at interpreter exit, when the suspended stream is finalized
    without an event loop and every retry fails at once.
    """

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        for _ in range(1000):
            try:
                async for item in downstream.generate(ctx):
                    yield item
                return
            except BaseException:
                continue


class PrefetchesInTaskGroup:
    """Pumps downstream into a buffer from a task, and yields inside the task group."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        send, receive = anyio.create_memory_object_stream[str](4)

        async def pump() -> None:
            async with send:
                async for item in downstream.generate(ctx):
                    await send.send(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(pump)
            async with receive:
                async for item in receive:
                    yield item


class DrainsInShield:
    """Reads all of downstream inside a shielded scope: cancellation cannot reach it."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        with anyio.CancelScope(shield=True):
            items = [item async for item in downstream.generate(ctx)]
        for item in items:
            yield item


@pytest.mark.parametrize(
    ("factory", "rule", "message"),
    [
        pytest.param(
            CatchesBaseException,
            "end when closed",
            "yielded again after its stream was closed",
            id="catches-base-exception",
        ),
        pytest.param(
            RetriesForeverOnClose,
            "end when closed",
            "called downstream again after its stream was closed",
            id="retries-on-close",
        ),
        pytest.param(
            PrefetchesInTaskGroup,
            "no task group or cancel scope open across a yield",
            "yielded inside a task group or cancel scope",
            id="prefetches-in-task-group",
        ),
    ],
)
async def test_check_operator_names_the_rule_a_raw_runtime_error_came_from(
    factory: Callable[[], OperatorProtocol[Any, Any, Any, Any]], rule: str, message: str
) -> None:
    with pytest.raises(ConformanceError, match=f"^{factory.__name__}: {message}") as info:
        await check_operator(factory, "req", ["a", "b", "c"])
    assert info.value.rule == rule
    assert info.value.operator == factory.__name__
    assert str(info.value).endswith(f"[rule: {rule}]")
    assert isinstance(info.value, AssertionError)


async def test_check_operator_ends_an_operator_that_drains_downstream_in_a_shield() -> None:
    # Without the watchdog this hangs forever: the shield keeps the time limit out, and the
    # scripted downstream waits for its context to stop, which nothing else would do.
    with pytest.raises(CheckTimeout, match=r"^DrainsInShield: the 'early stop' check ran over"):
        await check_operator(DrainsInShield, "req", ["a", "b", "c"], time_limit=0.5)


async def test_the_time_limit_covers_every_check_and_is_a_timeout_error() -> None:
    class SlowStart:
        """Waits, shielded, for longer than the limit before it calls downstream."""

        async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.2)
            async for item in downstream.generate(ctx):
                yield item

    with pytest.raises(TimeoutError) as info:
        await check_operator(SlowStart, "req", ["a"], time_limit=0.1)
    assert isinstance(info.value, CheckTimeout)
    assert info.value.rule == "respond to cancellation promptly"
    assert "'full run' check ran over check_operator's 0.1s limit" in str(info.value)


@pytest.mark.parametrize(
    "factory",
    [CatchesBaseException, RetriesForeverOnClose, PrefetchesInTaskGroup, DrainsInShield],
)
async def test_a_failed_check_leaves_the_callers_task_working(
    factory: Callable[[], OperatorProtocol[Any, Any, Any, Any]],
) -> None:
    with pytest.raises(ConformanceError):
        await check_operator(factory, "req", ["a", "b", "c"], time_limit=0.5)
    # The next check, in the same task, runs as if nothing happened ...
    await check_operator(Upper, "req", ["a", "b", "c"])
    # ... and so does everything else the task awaits, cancellation included.
    with anyio.move_on_after(0.01) as scope:
        await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert await collect(link(Upper(), ScriptedEngine(["x"])), make_context("req")) == ["X"]


#: the repository's root, where ``python -c`` imports this module by its dotted name
ROOT = Path(__file__).resolve().parents[2]
#: check every broken operator above on each backend, then collect and exit
_CHECK_BROKEN_AND_EXIT = """
import gc
import anyio
import tests.pipeline.test_check_operator as broken
from pipeline.testing import check_operator

async def main():
    for factory in (broken.CatchesBaseException, broken.RetriesForeverOnClose,
                    broken.PrefetchesInTaskGroup, broken.DrainsInShield):
        try:
            await check_operator(factory, "req", ["a", "b", "c"], time_limit=0.5)
        except AssertionError:
            pass
        else:
            raise SystemExit(f"{factory.__name__} passed its checks")

for backend in ("asyncio", "trio"):
    anyio.run(main, backend=backend)
gc.collect()
"""


@pytest.mark.slow
def test_the_streams_of_failed_checks_end_before_their_loop_closes() -> None:
    # A refusing operator's stream once outlived its loop: finalized at interpreter exit,
    # it printed "Exception ignored in: <async_generator ...>" after pytest's summary.
    run = subprocess.run(
        [sys.executable, "-c", _CHECK_BROKEN_AND_EXIT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
