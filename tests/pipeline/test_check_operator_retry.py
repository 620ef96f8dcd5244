"""check_operator(..., retry=True): an operator survives a retry only when what the retry
must resume lives in ctx.state, not in generate()'s locals or on the operator."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline import Context, Engine, StateKey, Stream, WorkerLost
from pipeline.testing import ConformanceError, check_operator

OUTPUTS = ["a", "b", "c"]

_COUNT = StateKey[list[int]]("test: outputs numbered so far")
_ARMED = StateKey[bool]("test: a retry is armed")


class Upper:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx):
            yield item.upper()


class NumbersInContext:
    """Numbers its outputs, keeping the count in the request's state: a retry resumes it."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        count = ctx.state.setdefault(_COUNT, [0])
        async for item in downstream.generate(ctx):
            count[0] += 1
            yield f"{count[0]}:{item}"


class NumbersInLocals:
    """The same, with the count in a local: a retry starts counting again."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        count = 0
        async for item in downstream.generate(ctx):
            count += 1
            yield f"{count}:{item}"


class NumbersOnTheOperator:
    """The same, with the count outside the request: a retry lands on a fresh count."""

    def __init__(self) -> None:
        self._count = 0

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx):
            self._count += 1
            yield f"{self._count}:{item}"


class BuffersInLocals:
    """Holds every output back until downstream ends: a lost worker loses them."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        items = [item async for item in downstream.generate(ctx)]
        for item in items:
            yield item


class FlushesUnlessArmed:
    """Holds back the latest output, and on a lost worker releases it unless a retry is
    armed in the request state (as the Backend does with withheld text)."""

    _HELD = StateKey[list[str]]("test: held back")

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        held = ctx.state.setdefault(self._HELD, [])
        try:
            async for item in downstream.generate(ctx):
                if held:
                    yield held.pop()
                held.append(item)
        except WorkerLost:
            if not ctx.state.get(_ARMED, False):
                while held:
                    yield "flushed:" + held.pop()
            raise
        while held:
            yield held.pop()


class SwallowsLostWorker:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        except WorkerLost:
            return


async def test_a_stateless_operator_survives_a_retry() -> None:
    await check_operator(Upper, "req", OUTPUTS, retry=True)


async def test_state_in_the_context_survives_a_retry() -> None:
    await check_operator(NumbersInContext, "req", OUTPUTS, retry=True)


@pytest.mark.parametrize("factory", [NumbersInLocals, NumbersOnTheOperator, BuffersInLocals])
async def test_state_outside_the_context_is_rejected_naming_the_rule(factory: Any) -> None:
    with pytest.raises(ConformanceError, match=f"^{factory.__name__}: downstream was lost") as info:
        await check_operator(factory, "req", OUTPUTS, retry=True)
    assert info.value.rule == "keep per-request state in ctx.state"


async def test_the_failure_shows_what_the_caller_got_and_what_it_should_have() -> None:
    with pytest.raises(ConformanceError) as info:
        await check_operator(NumbersInLocals, "req", OUTPUTS, retry=True)
    # Lost after the first output: the retry numbers from 1 again.
    assert "after 1 output(s)" in str(info.value)
    assert "['1:a', '1:b', '2:c'] instead of ['1:a', '2:b', '3:c']" in str(info.value)


async def test_the_retry_check_is_off_by_default() -> None:
    await check_operator(NumbersInLocals, "req", OUTPUTS)


async def test_before_attempt_does_what_the_retrying_operator_upstream_does() -> None:
    armed: list[Context[Any]] = []

    def arm(ctx: Context[Any]) -> None:
        armed.append(ctx)
        ctx.state.set(_ARMED, True)

    await check_operator(FlushesUnlessArmed, "req", OUTPUTS, retry=True, before_attempt=arm)
    # Once for the fault-free reference run, twice (one per attempt) for each fault point.
    assert len(armed) == 1 + 2 * len(OUTPUTS)
    with pytest.raises(ConformanceError, match=r"keep per-request state in ctx\.state"):
        await check_operator(FlushesUnlessArmed, "req", OUTPUTS, retry=True)


async def test_an_operator_that_swallows_a_lost_worker_cannot_be_retried() -> None:
    with pytest.raises(ConformanceError, match=r"^SwallowsLostWorker: swallowed the downstream"):
        await check_operator(SwallowsLostWorker, "req", OUTPUTS, retry=True)


async def test_the_retry_options_are_checked() -> None:
    with pytest.raises(ValueError, match="retry=True"):
        await check_operator(Upper, "req", OUTPUTS, before_attempt=lambda ctx: None)
    with pytest.raises(ValueError, match="at least one downstream output"):
        await check_operator(Upper, "req", [], retry=True)
