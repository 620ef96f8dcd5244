"""The mocker engine: its tokens, its roles, transfer handles, batching, faults and resumes."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Any

import anyio
import pytest

from operators.contracts.llm import (
    EngineOutput,
    MultimodalItem,
    PreprocessedRequest,
)
from operators.engines.mocker import DEFAULT_MAX_TOKENS, MockerEngine, MockerStatistics
from operators.testing import make_request
from pipeline import Context, EngineError, StreamDisconnected, open_stream
from pipeline.testing import collect, make_context

PROMPT = [10, 11, 12]
IMAGE = MultimodalItem(kind="image", data=b"\x89PNG fake", mime_type="image/png")


def fast(**options: Any) -> MockerEngine:
    """A mocker whose steps take no time."""
    return MockerEngine(prefill_ms_per_token=0.0, decode_ms_per_step=0.0, **options)


def ids(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


async def run(
    engine: MockerEngine, req: PreprocessedRequest, ctx_id: str = "req"
) -> list[EngineOutput]:
    return await collect(engine, make_context(req, id=ctx_id))


async def handoff(
    prefill: MockerEngine, req: PreprocessedRequest, ctx_id: str = "req"
) -> tuple[EngineOutput, PreprocessedRequest]:
    """Run ``req`` on ``prefill``; its one output and the decode request carrying the handle."""
    leg = dataclasses.replace(req, stop=dataclasses.replace(req.stop, max_tokens=1))
    [output] = await run(prefill, leg, ctx_id)
    return output, dataclasses.replace(req, prefill_result=output.prefill_result)


# ---------------------------------------------------------------------------- tokens


async def test_echo_cycles_the_prompt_and_finishes_with_length() -> None:
    outputs = await run(fast(), make_request(PROMPT, max_tokens=5))
    assert [out.token_ids for out in outputs] == [[10], [11], [12], [10], [11]]
    assert [out.finish_reason for out in outputs] == [None] * 4 + ["length"]
    assert all(out.logprobs is None and out.prefill_result is None for out in outputs)


async def test_default_max_tokens_is_16_and_special_ids_are_skipped() -> None:
    engine = fast(special_ids=(1, 2))
    outputs = await run(engine, make_request([1, 10, 2, 11]))
    assert len(outputs) == DEFAULT_MAX_TOKENS == 16
    assert set(ids(outputs)) == {10, 11}


async def test_random_tokens_are_a_function_of_seed_and_prompt() -> None:
    a = ids(await run(fast(tokens="random", seed=1), make_request(PROMPT, max_tokens=20)))
    b = ids(await run(fast(tokens="random", seed=1), make_request(PROMPT, max_tokens=20)))
    c = ids(await run(fast(tokens="random", seed=2), make_request(PROMPT, max_tokens=20)))
    d = ids(await run(fast(tokens="random", seed=1), make_request([7], max_tokens=20)))
    assert a == b
    assert a != c
    assert a != d
    assert all(256 <= t < 4096 for t in a)


async def test_logprobs_when_asked() -> None:
    outputs = await run(fast(), make_request(PROMPT, max_tokens=2, logprobs=2))
    for out in outputs:
        assert out.logprobs is not None
        assert out.top_logprobs is not None
        assert out.logprobs[0] < 0
        assert len(out.top_logprobs[0]) == 3
        assert out.top_logprobs[0][0] == (out.token_ids[0], out.logprobs[0])


async def test_n_choices_step_together() -> None:
    outputs = await run(fast(), make_request(PROMPT, max_tokens=2, n=2))
    steps = [(out.index, out.token_ids) for out in outputs]
    assert steps == [(0, [10]), (1, [10]), (0, [11]), (1, [11])]


async def test_max_tokens_zero_is_an_empty_terminal() -> None:
    outputs = await run(fast(), make_request(PROMPT, max_tokens=0))
    assert outputs == [EngineOutput(token_ids=[], finish_reason="length")]


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="role"):
        MockerEngine(role="verify")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_batch"):
        MockerEngine(max_batch=0)
    with pytest.raises(ValueError, match="fail_after_tokens"):
        MockerEngine(fail_after_tokens=-1)


# ----------------------------------------------------------------------------- roles


async def test_prefill_returns_one_token_and_a_signed_handle() -> None:
    prefill = fast(role="prefill", worker_id="p1")
    outputs = await run(prefill, make_request(PROMPT, max_tokens=8), "req-1")
    assert len(outputs) == 1
    [out] = outputs
    assert out.token_ids == [10]
    assert out.finish_reason == "length"
    handle = out.prefill_result
    assert isinstance(handle, dict)
    assert handle["worker_id"] == "p1"
    assert handle["request_id"] == "req-1"
    assert handle["prompt_tokens"] == len(PROMPT)
    assert handle["first_token"] == 10
    assert isinstance(handle["signature"], str)


async def test_decode_with_a_valid_handle_continues_after_the_first_token() -> None:
    prefill = fast(role="prefill")
    decode = fast(role="decode")
    aggregated = ids(await run(fast(), make_request(PROMPT, max_tokens=6)))
    first, decode_request = await handoff(prefill, make_request(PROMPT, max_tokens=6))
    rest = await run(decode, decode_request)
    assert first.token_ids + ids(rest) == aggregated
    assert len(rest) == 5
    assert rest[-1].finish_reason == "length"


async def test_decode_handle_with_random_tokens_matches_aggregated() -> None:
    aggregated = ids(await run(fast(tokens="random", seed=3), make_request(PROMPT, max_tokens=9)))
    first, decode_request = await handoff(
        fast(role="prefill", tokens="random", seed=3),
        make_request(PROMPT, max_tokens=9),
    )
    rest = await run(fast(role="decode", tokens="random", seed=3), decode_request)
    assert first.token_ids + ids(rest) == aggregated


async def test_decode_without_prefill_result_serves_aggregated() -> None:
    outputs = await run(fast(role="decode"), make_request(PROMPT, max_tokens=4))
    assert ids(outputs) == [10, 11, 12, 10]


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda h: {}, id="empty"),
        pytest.param(lambda h: ["not", "a", "dict"], id="list"),
        pytest.param(lambda h: {**h, "first_token": 99}, id="forged-first-token"),
        pytest.param(lambda h: {**h, "signature": "0" * 64}, id="forged-signature"),
        pytest.param(lambda h: {k: v for k, v in h.items() if k != "signature"}, id="unsigned"),
    ],
)
async def test_decode_rejects_a_forged_or_missing_handle(tamper: object) -> None:
    _, decode_request = await handoff(fast(role="prefill"), make_request(PROMPT, max_tokens=4))
    forged = tamper(decode_request.prefill_result)  # type: ignore[operator]
    bad = dataclasses.replace(decode_request, prefill_result=forged)
    with pytest.raises(EngineError, match="invalid or missing transfer handle"):
        await run(fast(role="decode"), bad)


async def test_decode_rejects_a_handle_for_another_request_or_prompt() -> None:
    decode = fast(role="decode")
    _, decode_request = await handoff(fast(role="prefill"), make_request(PROMPT, max_tokens=4))
    with pytest.raises(EngineError, match="issued for request 'req'"):
        await run(decode, decode_request, ctx_id="someone-else")
    longer = dataclasses.replace(decode_request, token_ids=[*PROMPT, 13])
    with pytest.raises(EngineError, match="prompt tokens"):
        await run(decode, longer)
    other = dataclasses.replace(decode_request, token_ids=[10, 11, 13])
    with pytest.raises(EngineError, match="another prompt"):
        await run(decode, other)


async def test_handles_from_another_secret_are_rejected() -> None:
    prefill = fast(role="prefill", transfer_secret=b"a")
    _, decode_request = await handoff(prefill, make_request(PROMPT, max_tokens=4))
    with pytest.raises(EngineError, match="signature"):
        await run(fast(role="decode", transfer_secret=b"b"), decode_request)
    rest = await run(fast(role="decode", transfer_secret=b"a"), decode_request)
    assert ids(rest) == [11, 12, 10]


async def test_encode_returns_an_object_shaped_encoder_result() -> None:
    encoder = fast(role="encode", worker_id="e1")
    outputs = await run(encoder, make_request(PROMPT, multimodal=(IMAGE, IMAGE)))
    assert len(outputs) == 1
    [out] = outputs
    assert out.token_ids == []
    assert out.finish_reason == "stop"
    assert out.encoder_result == {
        "embeddings": [
            {
                "index": i,
                "digest": hashlib.sha256(IMAGE.data).hexdigest()[:16],
                "mime_type": "image/png",
            }
            for i in range(2)
        ],
        "worker_id": "e1",
    }


async def test_an_encoder_result_must_describe_the_requests_images() -> None:
    [encoded] = await run(fast(role="encode"), make_request(PROMPT, multimodal=(IMAGE,)))
    good = make_request(
        PROMPT, max_tokens=2, multimodal=(IMAGE,), encoder_result=encoded.encoder_result
    )
    assert ids(await run(fast(), good)) == [10, 11]
    bad = dataclasses.replace(good, encoder_result={"embeddings": []})
    with pytest.raises(EngineError, match="encoder_result"):
        await run(fast(), bad)
    # another encoder's result is opaque: accepted as it is
    foreign = dataclasses.replace(good, encoder_result={"handle": "elsewhere"})
    assert ids(await run(fast(), foreign)) == [10, 11]


# ------------------------------------------------------------------ faults and resumes


async def test_fail_after_tokens_on_the_first_attempt_only() -> None:
    engine = fast(fail_after_tokens=2)
    seen: list[EngineOutput] = []
    ctx = make_context(make_request(PROMPT, max_tokens=6))
    with pytest.raises(StreamDisconnected):
        async with open_stream(engine, ctx) as stream:
            async for out in stream:
                seen.append(out)
    assert ids(seen) == [10, 11]
    # the retry (replayed_tokens > 0) continues the original sequence and does not fail
    retry = make_request([*PROMPT, 10, 11], max_tokens=4, replayed_tokens=2)
    assert ids(await run(engine, retry)) == [12, 10, 11, 12]
    assert engine.statistics().active == 0


async def test_fail_after_zero_tokens_fails_before_the_first() -> None:
    with pytest.raises(StreamDisconnected, match="before the first token"):
        await run(fast(fail_after_tokens=0), make_request(PROMPT, max_tokens=3))


async def test_replayed_tokens_continue_the_sequence() -> None:
    whole = ids(await run(fast(tokens="random"), make_request(PROMPT, max_tokens=10)))
    resumed = make_request([*PROMPT, *whole[:4]], max_tokens=6, replayed_tokens=4)
    assert ids(await run(fast(tokens="random"), resumed)) == whole[4:]


async def test_prefill_of_a_replayed_request_emits_the_next_position() -> None:
    resumed = make_request([*PROMPT, 10, 11], max_tokens=1, replayed_tokens=2)
    [out] = await run(fast(role="prefill"), resumed)
    assert out.token_ids == [12]
    assert out.prefill_result is not None
    assert out.prefill_result["prompt_tokens"] == 5


async def test_stop_generating_ends_cleanly_between_steps() -> None:
    engine = MockerEngine(prefill_ms_per_token=0.0, decode_ms_per_step=1.0)
    ctx: Context[PreprocessedRequest] = make_context(make_request(PROMPT, max_tokens=1000))
    seen: list[EngineOutput] = []
    async with open_stream(engine, ctx) as stream:
        async for out in stream:
            seen.append(out)
            if len(seen) == 3:
                ctx.stop_generating()
    assert len(seen) == 3
    assert all(out.finish_reason is None for out in seen)
    assert engine.statistics().active == 0


async def test_kill_ends_a_long_prefill_at_once() -> None:
    engine = MockerEngine(prefill_ms_per_token=1000.0, decode_ms_per_step=0.0)
    ctx = make_context(make_request(PROMPT, max_tokens=4))  # a 3 s prefill
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, engine, ctx)
        await anyio.wait_all_tasks_blocked()
        assert engine.statistics().active == 1
        ctx.kill()
    assert engine.statistics().active == 0
    # the killed request's prefill step is abandoned: the next request does not wait for it
    with anyio.fail_after(1):
        assert len(await run(engine, make_request([], max_tokens=2))) == 2


# ------------------------------------------------------------------------- timing


def test_concurrent_sequences_share_one_step_clock() -> None:
    # On trio's virtual clock (MockClock, autojump): time advances only when every task
    # sleeps, so the elapsed time is exactly the steps the engine slept through, however
    # loaded the machine is. (The engine is written against anyio, so trio runs it.)
    from trio.testing import MockClock

    async def main() -> tuple[float, int]:
        engine = MockerEngine(prefill_ms_per_token=0.0, decode_ms_per_step=2.0, max_batch=8)
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(run, engine, make_request(PROMPT, max_tokens=10), f"r{i}")
        return anyio.current_time() - start, engine.statistics().steps

    clock = MockClock(autojump_threshold=0)
    elapsed, steps = anyio.run(main, backend="trio", backend_options={"clock": clock})
    # 8 x 10 tokens in (about) 10 shared steps of 2 ms, not 80 serial ones
    assert 10 <= steps <= 12
    assert elapsed == pytest.approx(steps * 0.002)


async def test_requests_beyond_max_batch_wait_for_a_slot() -> None:
    engine = MockerEngine(prefill_ms_per_token=0.0, decode_ms_per_step=1.0, max_batch=2)
    seen: list[MockerStatistics] = []

    async def watched(i: int) -> None:
        async with open_stream(
            engine, make_context(make_request(PROMPT, max_tokens=5), id=f"r{i}")
        ) as s:
            async for _ in s:
                seen.append(engine.statistics())

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(watched, i)
    assert max(stats.active for stats in seen) == 2
    assert max(stats.waiting for stats in seen) == 4
    # 3 waves of 5 steps: the batch never grew past 2
    assert engine.statistics().steps >= 15
    stats = engine.statistics()
    assert (stats.active, stats.waiting) == (0, 0)


async def test_prefill_costs_time_per_prompt_token_and_stalls_decoding() -> None:
    engine = MockerEngine(prefill_ms_per_token=1.0, decode_ms_per_step=1.0)
    start = anyio.current_time()
    [first, *_] = await run(engine, make_request(list(range(100, 180)), max_tokens=2))
    assert first.token_ids == [100]
    assert anyio.current_time() - start >= 0.08  # 80 prompt tokens x 1 ms

    # A sequence decoding while another request's 80-token prefill joins its step waits
    # for that prefill: the step it shares is 81 ms long.
    times: list[float] = []
    decoding = anyio.Event()

    async def decode_long() -> None:
        ctx = make_context(make_request([5], max_tokens=30))
        async with open_stream(engine, ctx) as stream:
            async for _ in stream:
                times.append(anyio.current_time())
                if len(times) == 5:
                    decoding.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(decode_long)
        await decoding.wait()
        tg.start_soon(run, engine, make_request(list(range(100, 180)), max_tokens=1), "long")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) >= 0.07
    assert sorted(gaps)[len(gaps) // 2] < 0.02
