"""token_engine: a function that yields token ids becomes an engine that keeps the contract."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
from anyio.lowlevel import checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.contracts.resumption import continuation
from operators.engines import TokenEngine, token_engine
from operators.serving import build_app
from operators.testing import check_engine, make_request, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import InvalidRequest, open_stream
from pipeline.testing import collect, make_context

ANSWER = [50, 51, 52, 53, 54, 55, 56, 57]


def answering(answer: list[int]) -> TokenEngine:
    @token_engine
    async def reply(request: PreprocessedRequest) -> AsyncIterator[int]:
        for token_id in answer:
            yield token_id

    return reply


def by_choice(outputs: list[EngineOutput]) -> dict[int, tuple[list[int], str | None]]:
    """Per choice: its token ids, and its finish reason (None: it never ended)."""
    choices: dict[int, tuple[list[int], str | None]] = {}
    for output in outputs:
        ids, finish = choices.get(output.index, ([], None))
        assert finish is None, f"choice {output.index} got an output after its finish"
        choices[output.index] = ([*ids, *output.token_ids], output.finish_reason)
    return choices


async def run(engine: TokenEngine, request: PreprocessedRequest) -> list[EngineOutput]:
    return await collect(engine, make_context(request))


async def test_an_async_function_passes_check_engine() -> None:
    await check_engine(lambda: answering(ANSWER))


async def test_a_plain_iterable_and_an_endless_generator_pass_check_engine() -> None:
    def counting(request: PreprocessedRequest) -> Iterator[int]:
        token_id = 0
        while True:  # the engine's own limit is none: stop and kill end it
            token_id += 1
            yield token_id

    await check_engine(lambda: token_engine(lambda request: ANSWER))
    await check_engine(lambda: token_engine(counting))


@settings(max_examples=80, deadline=None)
@given(
    answer=st.lists(st.integers(0, 9), max_size=12),
    n=st.integers(1, 3),
    max_tokens=st.none() | st.integers(0, 14),
    min_tokens=st.integers(0, 4),
    stop_ids=st.sets(st.integers(0, 9), max_size=2),
    data=st.data(),
)
def test_each_choice_is_the_answer_cut_where_the_contract_says(
    answer: list[int],
    n: int,
    max_tokens: int | None,
    min_tokens: int,
    stop_ids: set[int],
    data: st.DataObject,
) -> None:
    first = make_request(
        [1, 2], n=n, max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=sorted(stop_ids)
    )
    engine = token_engine(lambda request: answer)
    expected: list[int] = []
    finish = "length" if max_tokens == 0 else "stop"
    by_stop_id = False
    for count, token_id in enumerate(answer if max_tokens != 0 else (), 1):
        expected.append(token_id)
        if token_id in stop_ids and count > min_tokens:
            by_stop_id = True
            break
        if max_tokens is not None and count >= max_tokens:
            finish = "length"
            break
    whole = anyio.run(run, engine, first)
    assert by_choice(whole) == dict.fromkeys(range(n), (expected, finish))
    # A migration after k tokens (of a choice still running, as Migration retries one): the
    # rest, with the same finish, from the request Migration sends.
    k = data.draw(st.integers(0, max(len(expected) - by_stop_id, 0)), label="replayed")
    rest = anyio.run(run, engine, continuation(first, expected[:k]))
    assert by_choice(rest) == dict.fromkeys(range(n), (expected[k:], finish))


async def test_the_function_sees_the_request_as_a_first_attempt() -> None:
    seen: list[PreprocessedRequest] = []

    def remember(request: PreprocessedRequest) -> list[int]:
        seen.append(request)
        return ANSWER

    first = make_request([1, 2, 3], max_tokens=6, min_tokens=4, temperature=0.5, n=2)
    resumed = continuation(first, ANSWER[:2])
    outputs = await run(token_engine(remember), resumed)
    assert by_choice(outputs) == {0: (ANSWER[2:6], "length"), 1: (ANSWER[2:6], "length")}
    assert len(seen) == 2  # one call per choice
    for request in seen:
        assert request.token_ids == [1, 2, 3]  # the prompt, not the replayed output
        assert (request.replayed_tokens, request.n) == (0, 1)
        assert (request.stop.max_tokens, request.stop.min_tokens) == (6, 4)
        assert request.sampling.temperature == 0.5


async def test_eos_stops_unless_ignored() -> None:
    engine = answering([5, 2, 7])
    assert by_choice(await run(engine, make_request(eos_token_ids=[2]))) == {0: ([5, 2], "stop")}
    ignored = make_request(eos_token_ids=[2], ignore_eos=True)
    assert by_choice(await run(engine, ignored)) == {0: ([5, 2, 7], "stop")}


@pytest.mark.parametrize(
    ("request_", "param"),
    [(make_request([]), "prompt"), (make_request(logprobs=0), "logprobs")],
    ids=["empty prompt", "logprobs"],
)
async def test_what_it_cannot_serve_is_refused_by_name(
    request_: PreprocessedRequest, param: str
) -> None:
    calls: list[PreprocessedRequest] = []
    with pytest.raises(InvalidRequest) as refused:
        await run(token_engine(lambda request: calls.append(request) or ANSWER), request_)
    assert refused.value.param == param
    assert calls == []


@pytest.mark.parametrize("how", ["stop", "kill", "close"])
async def test_the_functions_iterators_are_closed_however_the_stream_ends(how: str) -> None:
    closed: list[str] = []

    async def slow(request: PreprocessedRequest) -> AsyncIterator[int]:
        try:
            for token_id in range(1000):
                await checkpoint()
                yield token_id
        finally:
            closed.append("async")

    def plain(request: PreprocessedRequest) -> Iterator[int]:
        try:
            yield from range(1000)
        finally:
            closed.append("plain")

    for fn in (slow, plain):
        ctx = make_context(make_request(n=2))
        async with open_stream(token_engine(fn), ctx) as stream:
            async for output in stream:
                if output.index == 0:
                    continue  # (a generator that never started has nothing to close)
                if how == "stop":
                    ctx.stop_generating()
                elif how == "kill":
                    ctx.kill()
                else:
                    break
    assert closed == ["async", "async", "plain", "plain"]


async def test_its_errors_reach_the_caller_unchanged() -> None:
    async def failing(request: PreprocessedRequest) -> AsyncIterator[int]:
        yield 1
        raise InvalidRequest("no such adapter", param="model")

    with pytest.raises(InvalidRequest, match="no such adapter"):
        await run(token_engine(failing), make_request())


def test_it_takes_a_function() -> None:
    with pytest.raises(TypeError, match="takes a function"):
        token_engine([1, 2, 3])  # type: ignore[arg-type]


async def test_it_serves_over_the_openai_api() -> None:
    tokenizer = Tokenizer.default()
    answer = tokenizer.encode("Hello there, friend")
    app = build_app(answering(answer), tokenizer, model_name="mine")
    async with openai_client(app) as client:
        reply = await client.chat.completions.create(
            model="mine", messages=[{"role": "user", "content": "Hi"}], n=2, stop=[","]
        )
        assert [c.message.content for c in reply.choices] == ["Hello there"] * 2
        assert [c.finish_reason for c in reply.choices] == ["stop"] * 2
        cut = await client.completions.create(model="mine", prompt="Hi", max_tokens=2)
        assert cut.choices[0].finish_reason == "length"
        with pytest.raises(Exception, match="logprobs") as refused:
            await client.completions.create(model="mine", prompt="Hi", logprobs=1)
        assert getattr(refused.value, "status_code", None) == 400
