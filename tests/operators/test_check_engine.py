"""check_engine: the shipped engines pass it, and each broken engine fails its rule by name."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.engines import EchoEngine
from operators.engines.mocker import MockerEngine
from operators.testing import check_engine
from pipeline import Context, FunctionEngine, InvalidRequest


async def test_the_echo_engine_passes() -> None:
    await check_engine(lambda: EchoEngine(cycle=True))


@pytest.mark.parametrize("tokens", ["echo", "random"])
async def test_the_mocker_passes(tokens: Any) -> None:
    await check_engine(
        lambda: MockerEngine(prefill_ms_per_token=0.0, decode_ms_per_step=0.1, tokens=tokens)
    )


def engine_of(fn: Any) -> Any:
    return lambda: FunctionEngine(fn)


async def counting(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    """A correct engine: token k of choice i is 100 * i + position; honours everything."""
    request = ctx.data
    limit = request.stop.max_tokens or 10**9
    start = request.replayed_tokens
    for step in range(limit):
        for index in range(request.n):
            if ctx.is_stopped:
                return
            await checkpoint()
            last = step == limit - 1
            yield EngineOutput(
                [100 * index + start + step], [0.0], None, "length" if last else None, index
            )


async def only_first_choice(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    yield EngineOutput([1], finish_reason="length")


async def no_finish(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    for index in range(ctx.data.n):
        yield EngineOutput([1], index=index)


async def past_max_tokens(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    for index in range(ctx.data.n):
        yield EngineOutput([1] * 9, finish_reason="length", index=index)


async def deaf(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    """Right in every way but one: it never looks at ``is_stopped``."""
    limit = ctx.data.stop.max_tokens or 10
    for step in range(limit):
        for index in range(ctx.data.n):
            await checkpoint()
            yield EngineOutput([step], finish_reason="length" if step == limit - 1 else None,
                               index=index)  # fmt: skip


async def restarts(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    """Right in every way but one: it ignores ``replayed_tokens``."""
    request = ctx.data
    fresh = PreprocessedRequest(token_ids=request.token_ids, stop=request.stop, n=request.n)
    async for output in counting(ctx.replace(fresh)):
        yield output


async def raises_value_error(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    raise ValueError("bad")
    yield EngineOutput([1])  # pragma: no cover


async def test_a_correct_engine_passes() -> None:
    await check_engine(engine_of(counting))


async def without_logprobs(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    """``counting`` for an engine that has no logprobs, and says so by name."""
    if ctx.data.output.logprobs is not None:
        raise InvalidRequest("no logprobs here", param="logprobs")
    async for output in counting(ctx):
        yield output


async def test_an_engine_may_refuse_logprobs_by_name() -> None:
    await check_engine(engine_of(without_logprobs))


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (only_first_choice, "choices"),
        (no_finish, "never got a finish_reason"),
        (past_max_tokens, "max_tokens=4"),
        (deaf, "stop_generating"),
        (restarts, "continued with"),
        (raises_value_error, "RequestError"),
    ],
)
async def test_a_broken_engine_fails_its_rule(fn: Any, message: str) -> None:
    with anyio.fail_after(30), pytest.raises(AssertionError, match=message):
        await check_engine(engine_of(fn), time_limit=5)


class Embedding(FunctionEngine[PreprocessedRequest, EngineOutput]):
    """``counting``, plus an ``embed`` that breaks the rule ``broken`` names (or none)."""

    def __init__(self, broken: str | None = None) -> None:
        super().__init__(counting)
        self.broken = broken
        self.calls = 0

    async def embed(self, token_ids: Any, /) -> list[list[float]]:
        self.calls += 1
        if any(not tokens for tokens in token_ids) and self.broken != "empty":
            raise InvalidRequest("an input is empty", param="input.0")
        vectors = [[float(sum(tokens)), float(len(tokens))] for tokens in token_ids]
        if self.broken == "count":
            return vectors[:1]
        if self.broken == "lengths":
            return [vector[: 1 + index % 2] for index, vector in enumerate(vectors)]
        if self.broken == "batch" and len(token_ids) > 1:  # a batch shifts every vector
            return [[x + 1e-6 for x in vector] for vector in vectors]
        return vectors


async def test_an_engine_that_embeds_correctly_passes() -> None:
    engine = Embedding()
    await check_engine(lambda: engine)
    assert engine.calls >= 5  # batched, alone (x3), reversed, again, empty


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("count", "vectors for 3 inputs"),
        ("lengths", "vectors of lengths"),
        ("batch", "other vectors alone than batched"),
        ("empty", "accepted an empty input"),
    ],
)
async def test_an_engine_that_embeds_wrongly_fails_its_rule(broken: str, message: str) -> None:
    with anyio.fail_after(30), pytest.raises(AssertionError, match=message):
        await check_engine(lambda: Embedding(broken), time_limit=5)
