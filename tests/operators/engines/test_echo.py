"""The echo engine: what it streams for a prompt, and how it stops, fails and resumes."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.contracts.resumption import continuation
from operators.engines import DEFAULT_CYCLE_TOKENS, EchoEngine, echo_logprob
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer
from pipeline import StreamDisconnected, open_stream
from pipeline.testing import collect, make_context

SPECIAL = (1, 2)


async def run(engine: EchoEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    with anyio.fail_after(5):
        return await collect(engine, make_context(req))


def ids(outputs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.token_ids]


def finishes(outputs: list[EngineOutput]) -> list[tuple[int, str]]:
    return [(out.index, out.finish_reason) for out in outputs if out.finish_reason is not None]


async def test_echoes_prompt_ids_skipping_specials_then_stops() -> None:
    outputs = await run(EchoEngine(SPECIAL), make_request([1, 10, 11, 2, 12, 2]))
    assert [out.token_ids for out in outputs] == [[10], [11], [12]]
    # the finish reason rides on the last token: no extra (EOS) token
    assert [out.finish_reason for out in outputs] == [None, None, "stop"]
    assert all(out.logprobs is None and out.top_logprobs is None for out in outputs)


async def test_max_tokens_first_finishes_with_length() -> None:
    outputs = await run(EchoEngine(SPECIAL), make_request([10, 11, 12], max_tokens=2))
    assert ids(outputs) == [10, 11]
    assert finishes(outputs) == [(0, "length")]


async def test_max_tokens_equal_to_echo_is_length() -> None:
    outputs = await run(EchoEngine(), make_request([10, 11], max_tokens=2))
    assert finishes(outputs) == [(0, "length")]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "reason"),
    [([], None, "stop"), ([1, 2], None, "stop"), ([5], 0, "length")],
)
async def test_nothing_to_echo_finishes_at_once(
    prompt: list[int], max_tokens: int | None, reason: str
) -> None:
    outputs = await run(EchoEngine(SPECIAL), make_request(prompt, max_tokens=max_tokens, n=2))
    assert [(out.token_ids, out.index, out.finish_reason) for out in outputs] == [
        ([], 0, reason),
        ([], 1, reason),
    ]


async def test_n_choices_are_interleaved_with_the_same_tokens() -> None:
    outputs = await run(EchoEngine(), make_request([10, 11], n=3))
    assert [(out.index, out.token_ids) for out in outputs] == [
        (0, [10]),
        (1, [10]),
        (2, [10]),
        (0, [11]),
        (1, [11]),
        (2, [11]),
    ]
    assert finishes(outputs) == [(0, "stop"), (1, "stop"), (2, "stop")]


@pytest.mark.parametrize("k", [0, 1, 5])
async def test_logprobs_are_deterministic_and_sampled_first(k: int) -> None:
    engine = EchoEngine(vocab_size=50)
    outputs = await run(engine, make_request([10, 49, 3], logprobs=k))
    assert outputs == await run(engine, make_request([10, 49, 3], logprobs=k))
    for out in outputs:
        (token_id,) = out.token_ids
        assert out.logprobs == [echo_logprob(token_id)]
        assert out.top_logprobs is not None
        (top,) = out.top_logprobs
        assert len(top) == k + 1
        assert top[0] == (token_id, echo_logprob(token_id))
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert all(0 <= other < 50 for other, _ in top)
    assert all(echo_logprob(t) < 0 for t in range(100))


async def test_cycle_repeats_until_max_tokens() -> None:
    outputs = await run(
        EchoEngine(SPECIAL, cycle=True), make_request([1, 10, 11, 12, 2], max_tokens=7)
    )
    assert ids(outputs) == [10, 11, 12, 10, 11, 12, 10]
    assert finishes(outputs) == [(0, "length")]


async def test_cycle_without_max_tokens_is_capped() -> None:
    outputs = await run(EchoEngine(cycle=True), make_request([10, 11]))
    assert len(ids(outputs)) == DEFAULT_CYCLE_TOKENS
    assert finishes(outputs) == [(0, "length")]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 20), max_size=12),
    max_tokens=st.none() | st.integers(0, 30),
    cycle=st.booleans(),
    data=st.data(),
)
def test_a_retry_continues_the_original_echo(
    prompt: list[int], max_tokens: int | None, cycle: bool, data: st.DataObject
) -> None:
    engine = EchoEngine(SPECIAL, cycle=cycle)
    first = make_request(prompt, max_tokens=max_tokens)
    full = anyio.run(run, engine, first)
    full_ids = ids(full)
    k = data.draw(st.integers(0, len(full_ids)))
    resumed = anyio.run(run, engine, continuation(first, full_ids[:k]))
    assert full_ids[:k] + ids(resumed) == full_ids
    assert finishes(resumed) == finishes(full)


async def test_fail_after_tokens_fails_the_first_attempt_only() -> None:
    engine = EchoEngine(fail_after_tokens=2)
    first = make_request([10, 11, 12, 13])
    seen: list[EngineOutput] = []
    with anyio.fail_after(5), pytest.raises(StreamDisconnected) as raised:
        async with open_stream(engine, make_context(first, id="req-1")) as stream:
            async for out in stream:
                seen.append(out)
    assert ids(seen) == [10, 11]
    assert raised.value.request_id == "req-1"
    resumed = await run(engine, continuation(first, [10, 11]))
    assert ids(resumed) == [12, 13]
    assert finishes(resumed) == [(0, "stop")]


async def test_fail_after_zero_fails_before_any_token() -> None:
    with pytest.raises(StreamDisconnected):
        await run(EchoEngine(fail_after_tokens=0), make_request([10]))
    with pytest.raises(StreamDisconnected):
        await run(EchoEngine(fail_after_tokens=0), make_request([]))


async def test_fail_after_beyond_the_stream_never_fires() -> None:
    outputs = await run(EchoEngine(fail_after_tokens=2), make_request([10, 11]))
    assert finishes(outputs) == [(0, "stop")]


async def test_stop_generating_ends_the_stream_cleanly() -> None:
    ctx = make_context(make_request([10, 11, 12, 13]))
    seen: list[EngineOutput] = []
    with anyio.fail_after(5):
        async with open_stream(EchoEngine(), ctx) as stream:
            async for out in stream:
                seen.append(out)
                ctx.stop_generating()
    assert ids(seen) == [10]
    assert not ctx.is_killed


async def test_kill_interrupts_a_delayed_stream() -> None:
    ctx = make_context(make_request([10, 11, 12]))
    seen: list[EngineOutput] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                async with open_stream(EchoEngine(delay_ms=60_000), ctx) as stream:
                    seen.extend([out async for out in stream])

            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            ctx.kill()
    assert seen == []


async def test_delay_is_per_step() -> None:
    start = anyio.current_time()
    outputs = await run(EchoEngine(delay_ms=20), make_request([10, 11, 12], n=2))
    assert anyio.current_time() - start >= 0.055
    assert len(outputs) == 6


async def test_from_tokenizer_echoes_a_chat_prompt_without_its_markers() -> None:
    tokenizer = Tokenizer.default()
    prompt = tokenizer.encode("<|im_start|>user\nhello 😀 日本語<|im_end|>\n")
    outputs = await run(EchoEngine.from_tokenizer(tokenizer), make_request(prompt))
    assert tokenizer.decode(ids(outputs)) == "user\nhello 😀 日本語\n"
    assert finishes(outputs) == [(0, "stop")]


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="delay_ms"):
        EchoEngine(delay_ms=-1)
    with pytest.raises(ValueError, match="fail_after_tokens"):
        EchoEngine(fail_after_tokens=-1)
    assert "cycle=True" in repr(EchoEngine(cycle=True, delay_ms=5))
