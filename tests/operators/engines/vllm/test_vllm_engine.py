"""The vLLM engine on a real vLLM (the CPU build) and SmolLM2: the engine contract, aborts,
replays (constrained ones included), reasoning budgets, KV events in our block ids,
statistics, cleanup.

One engine serves the whole module (starting vLLM takes tens of seconds on two cores), on
one event loop: vLLM's client tasks live on the loop the engine first ran on.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio

from operators.contracts.llm import (
    Constraint,
    EngineOutput,
    PreprocessedRequest,
    ReasoningBudget,
    SamplingOptions,
    StopConditions,
)
from operators.engines.vllm import VllmEngine
from operators.routing.kv_blocks import block_hashes
from operators.testing import check_engine, make_request
from operators.text.tokenizer import Tokenizer
from pipeline import Context, KvEvent, KvStored, open_stream
from tests.helpers.vllm_support import eventually, gone, requires_vllm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.time_limit(120),
]

TOKENIZER = Tokenizer.default()
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
FRANCE = TOKENIZER.encode(CHAT.format("What is the capital of France?"))
STORY = TOKENIZER.encode(CHAT.format("Tell me a long story about a lighthouse keeper."))
#: a prompt of several of vLLM's 32-token blocks (shorter ones have nothing to cache)
SYSTEM = "<|im_start|>system\nYou answer questions about geography in one sentence.<|im_end|>\n"
LONG = TOKENIZER.encode(SYSTEM * 4 + CHAT.format("What is the capital of Italy?"))
CITY = Constraint(
    param="response_format",
    json_schema={
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    },
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine() -> AsyncIterator[VllmEngine]:
    requires_vllm()
    engine = await anyio.to_thread.run_sync(lambda: VllmEngine(max_model_len=1024))
    processes = engine.processes
    assert processes, "vLLM started no process of its own?"
    yield engine
    await engine.aclose()
    assert gone(processes), f"vLLM's processes {sorted(processes)} outlived aclose()"
    assert engine.processes == frozenset()


#: every request here: greedy, 12 tokens, stopping at the tokenizer's EOS
request = functools.partial(
    make_request, max_tokens=12, eos_token_ids=sorted(TOKENIZER.eos_token_ids), temperature=0.0
)


async def run(engine: VllmEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    outputs = []
    async with open_stream(engine, Context.new(req)) as stream:
        async for output in stream:
            outputs.append(output)
    return outputs


def tokens(outputs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def unfinished(engine: VllmEngine) -> int:
    return int(engine.async_llm.get_num_unfinished_requests())


async def test_the_engine_keeps_the_contract(engine: VllmEngine) -> None:
    await check_engine(lambda: engine, prompt=FRANCE, time_limit=60)


async def test_greedy_answers_are_the_models_and_end_with_a_finish_reason(
    engine: VllmEngine,
) -> None:
    outputs = await run(engine, request(FRANCE, max_tokens=40))
    assert "Paris" in TOKENIZER.decode(tokens(outputs))
    assert outputs[-1].finish_reason == "stop"  # the model's end of turn, emitted with it
    assert outputs[-1].token_ids[-1] in TOKENIZER.eos_token_ids
    assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    again = await run(engine, request(FRANCE, max_tokens=40))
    assert tokens(again) == tokens(outputs)


async def test_a_repeated_prompt_reports_its_cached_tokens(engine: VllmEngine) -> None:
    first = await run(engine, request(LONG, max_tokens=4))
    again = await run(engine, request(LONG, max_tokens=4))
    assert tokens(again) == tokens(first)
    cached = again[0].cached_tokens
    assert cached is not None
    assert 0 < cached < len(LONG)
    assert cached % engine.vllm_block_size == 0


async def test_n_choices_greedy_are_identical_and_seeded_sampling_repeats(
    engine: VllmEngine,
) -> None:
    greedy = await run(engine, request(FRANCE, n=3, max_tokens=8, ignore_eos=True))
    assert {o.index for o in greedy} == {0, 1, 2}
    assert tokens(greedy, 0) == tokens(greedy, 1) == tokens(greedy, 2)
    assert tokens(greedy, 0) == tokens(await run(engine, request(FRANCE, max_tokens=8)))[:8]
    seeded = request(STORY, n=2, max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    first, second = await run(engine, seeded), await run(engine, seeded)
    assert [tokens(first, i) for i in (0, 1)] == [tokens(second, i) for i in (0, 1)]
    assert tokens(first, 0) != tokens(first, 1)  # each choice its own seed


async def test_logprobs_align_with_the_tokens(engine: VllmEngine) -> None:
    outputs = await run(engine, request(FRANCE, max_tokens=6, logprobs=3, ignore_eos=True))
    for output in outputs:
        assert output.logprobs is not None
        assert output.top_logprobs is not None
        assert len(output.logprobs) == len(output.top_logprobs) == len(output.token_ids)
        for token, logprob, top in zip(
            output.token_ids, output.logprobs, output.top_logprobs, strict=True
        ):
            assert len(top) == 3
            assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
            assert top[0] == (token, logprob)  # greedy: the sampled token is the best


async def test_a_kill_aborts_the_request_inside_vllm(engine: VllmEngine) -> None:
    ctx = Context.new(request(STORY, max_tokens=500, ignore_eos=True))
    seen = 0
    async with open_stream(engine, ctx) as stream:
        async for _ in stream:
            seen += 1
            if seen == 3:
                assert unfinished(engine) == 1
                ctx.kill()
    assert ctx.is_killed
    assert unfinished(engine) == 0  # aborted before the stream ended
    await eventually(lambda: engine.statistics().running_requests == 0, "vLLM's running count")


async def test_a_stop_and_a_deadline_abort_too(engine: VllmEngine) -> None:
    ctx = Context.new(request(STORY, max_tokens=500, ignore_eos=True))
    async with open_stream(engine, ctx) as stream:
        async for _ in stream:
            ctx.stop_generating()
    assert not ctx.is_killed
    assert unfinished(engine) == 0
    deadline = Context.new(
        request(STORY, max_tokens=500, ignore_eos=True), deadline=anyio.current_time() + 1.0
    )
    got = 0
    async with open_stream(engine, deadline) as stream:
        async for output in stream:
            got += len(output.token_ids)
    assert deadline.is_killed
    assert 0 < got < 500
    assert unfinished(engine) == 0
    await eventually(lambda: engine.statistics().running_requests == 0, "vLLM's running count")


@pytest.mark.parametrize("k", [1, 5, 11])
async def test_a_replayed_request_continues_exactly(engine: VllmEngine, k: int) -> None:
    whole = tokens(await run(engine, request(STORY, max_tokens=16, ignore_eos=True)))
    replayed = request(STORY + whole[:k], max_tokens=16 - k, ignore_eos=True, replayed_tokens=k)
    rest = await run(engine, replayed)
    assert tokens(rest) == whole[k:]
    assert rest[-1].finish_reason == "length"


async def test_structured_output_matches_and_a_replay_continues_it_validly(
    engine: VllmEngine,
) -> None:
    prompt = TOKENIZER.encode(CHAT.format("Name a city and its country, as JSON."))
    whole = tokens(await run(engine, request(prompt, max_tokens=60, constraint=CITY)))
    text = TOKENIZER.decode(whole, skip_special_tokens=True)
    answer = json.loads(text)
    assert set(answer) == {"city", "country"}
    # Migrated at any point, the grammar is continued past the replayed tokens: a fresh
    # grammar would have to start a second object after the replayed "{...".
    for k in (1, 4, len(whole) // 2):
        rest = await run(
            engine,
            request(prompt + whole[:k], max_tokens=60 - k, constraint=CITY, replayed_tokens=k),
        )
        assert whole[:k] + tokens(rest) == whole, k


#: a prompt that opens the reasoning (SmolLM2 never closes it on its own), and the budget's
#: markers as the preprocessor encodes them
THINKING = STORY + TOKENIZER.encode("<think>\n")
END = tuple(TOKENIZER.encode("</think>"))
START = tuple(TOKENIZER.encode("<think>"))


def budgeted(tokens_: int, **more: Any) -> PreprocessedRequest:
    budget = ReasoningBudget(
        param="thinking_token_budget", tokens=tokens_, end=END, start=START, open=True
    )
    return request(THINKING, max_tokens=30, ignore_eos=True, reasoning_budget=budget, **more)


def find(sequence: list[int], marker: tuple[int, ...]) -> int:
    """Where ``marker`` first starts in ``sequence`` (-1: nowhere)."""
    return next(
        (i for i in range(len(sequence)) if tuple(sequence[i : i + len(marker)]) == marker), -1
    )


async def test_a_reasoning_budget_forces_the_end_marker(engine: VllmEngine) -> None:
    alone = tokens(await run(engine, request(THINKING, max_tokens=30, ignore_eos=True)))
    assert find(alone, END) == -1  # left alone, SmolLM2 never ends its reasoning
    forced = tokens(await run(engine, budgeted(8)))
    assert forced[:8] == alone[:8]  # the same reasoning, up to the budget
    assert find(forced, END) == 8  # then the end marker, at once
    assert len(forced) == 30  # and the answer goes on


@pytest.mark.parametrize("k", [3, 9, 14])
async def test_a_replayed_budgeted_request_continues_exactly(engine: VllmEngine, k: int) -> None:
    whole = tokens(await run(engine, budgeted(8)))
    replayed = PreprocessedRequest(
        token_ids=THINKING + whole[:k],
        stop=StopConditions(max_tokens=30 - k, ignore_eos=True),
        sampling=SamplingOptions(temperature=0.0),
        replayed_tokens=k,
        reasoning_budget=budgeted(8).reasoning_budget,
    )
    assert whole[:k] + tokens(await run(engine, replayed)) == whole


async def test_the_kv_events_name_vllms_blocks_by_our_block_ids(engine: VllmEngine) -> None:
    events: list[KvEvent] = []
    engine.kv_events = events.append
    try:
        prompt = TOKENIZER.encode(" ".join(f"word{i}" for i in range(60)))[:100]
        assert len(prompt) == 100
        await run(engine, request(prompt, max_tokens=1))
        ours = block_hashes(prompt, engine.block_size)
        full = len(prompt) // engine.vllm_block_size * engine.vllm_block_size
        expected = set(block_hashes(prompt[:full], engine.block_size))
        assert (engine.block_size, engine.vllm_block_size) == (16, 32)
        await eventually(
            lambda: expected <= set(engine.kv_snapshot().block_ids), "the prompt's blocks"
        )
        stored = [b for e in events if isinstance(e, KvStored) for b in e.block_ids]
        assert expected <= set(stored)
        assert set(ours) - expected <= set(ours[len(expected) :])  # a partial block is not held
        snapshot = engine.kv_snapshot()
        assert snapshot.seq == events[-1].seq  # the snapshot is as of the last event
    finally:
        engine.kv_events = None


async def test_statistics_show_a_running_request(engine: VllmEngine) -> None:
    before = engine.statistics()
    ctx = Context.new(request(STORY, max_tokens=200, ignore_eos=True))
    async with open_stream(engine, ctx) as stream:
        async for _ in stream:
            await eventually(lambda: engine.statistics().running_requests == 1, "running")
            assert engine.statistics().kv_cache_usage > 0
            ctx.stop_generating()
    after = engine.statistics()
    assert after.requests == before.requests + 1
    assert after.prompt_tokens == before.prompt_tokens + len(STORY)
    assert 0 < after.generated_tokens - before.generated_tokens < 200


async def test_the_load_report_follows_a_request_from_prompt_to_decoding(
    engine: VllmEngine,
) -> None:
    assert engine.load_report().work() == 0  # (idle)
    ctx = Context.new(request(STORY, max_tokens=200, ignore_eos=True))
    stream = open_stream(engine, ctx)
    async with stream as outputs:
        report = None
        async for _ in outputs:
            report = engine.load_report()
            ctx.stop_generating()
    assert report is not None
    assert (report.decoding, report.waiting, report.prefill_tokens) == (1, 0, 0)
    assert report.kv_usage is not None
    assert engine.load_report().work() == 0
