"""The LLM hot-path vocabulary: what flows between the LLM operators and engines.

These are plain ``slots`` dataclasses, built once per request or once per engine step;
pydantic stays at the HTTP edge (``operators/edges/openai/protocol/``). The flow::

    OpenAI request --[OpenAIPreprocessor]--> PreprocessedRequest --> ... --> engine
    OpenAI chunks  <--[OpenAIPreprocessor]-- BackendOutput <--[Backend]-- EngineOutput

Keep this module to type definitions; behaviour lives in the operator that owns it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

__all__ = (
    "CONSTRAINED_DECODING",
    "LORA",
    "REASONING_BUDGET",
    "BackendOutput",
    "Constraint",
    "Embedder",
    "EngineOutput",
    "FinishReason",
    "HasFeatures",
    "LoraEngine",
    "MultimodalItem",
    "OutputOptions",
    "PreprocessedRequest",
    "ReasoningBudget",
    "SamplingOptions",
    "StopConditions",
    "Tool",
    "ToolCallDelta",
    "TopLogprobs",
    "embedder_of",
    "engine_features",
    "lora_engine_of",
)

FinishReason = Literal["stop", "length", "tool_calls"]
"""Why a choice ended. Errors are raised, never reported as a finish reason. Engines end
choices with ``"stop"`` or ``"length"``; a tool-call parser turns ``"stop"`` into
``"tool_calls"`` when the choice called a tool."""

TopLogprobs = list[tuple[int, float]]
"""The most likely alternatives at one position: ``(token_id, logprob)``, best first."""


@dataclass(slots=True, kw_only=True)
class StopConditions:
    """When a choice stops. Checked by the Backend; engines may enforce them too."""

    #: most tokens to generate (None: the engine's limit)
    max_tokens: int | None = None
    #: no stop check (string, token or EOS) fires before this many tokens
    min_tokens: int = 0
    #: stop strings; hidden from the output unless ``include_stop_str_in_output``
    stop: tuple[str, ...] = ()
    #: the user's stop token ids: hidden, and reported as ``stop_reason``
    stop_token_ids: tuple[int, ...] = ()
    #: end-of-sequence ids, from the tokenizer: hidden stops unless ``ignore_eos``
    eos_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False


@dataclass(slots=True, kw_only=True)
class SamplingOptions:
    """How the engine samples; validated at the edge, interpreted by the engine."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: sample among the k most likely tokens only (None, 0 or -1: all of them)
    top_k: int | None = None
    #: drop tokens less likely than ``min_p`` times the most likely one (None or 0: none)
    min_p: float | None = None
    #: divide (or multiply, when negative) the logits of tokens already in prompt or output
    #: (None or 1: none)
    repetition_penalty: float | None = None


@dataclass(slots=True, kw_only=True)
class OutputOptions:
    """What the client wants to see besides text."""

    #: None: no logprobs; k >= 0: the sampled token's logprob plus the k best alternatives
    logprobs: int | None = None
    skip_special_tokens: bool = True


@dataclass(slots=True, kw_only=True)
class MultimodalItem:
    """One non-text input (an image), already fetched and validated at the edge."""

    kind: Literal["image"]
    data: bytes
    mime_type: str


@dataclass(slots=True, frozen=True, kw_only=True)
class Tool:
    """A function the model may call (OpenAI's ``tools[i].function``)."""

    name: str
    description: str | None = None
    #: the arguments' JSON schema (None: any object)
    parameters: Mapping[str, Any] | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class Constraint:
    """What a choice's output must be, for an engine that decodes under constraints.

    The output is ``prefix + JSON + suffix``: a JSON value matching ``json_schema`` (any
    JSON object when None) between literal texts. With ``repeat`` it is one or more such
    pieces joined by ``separator`` (several tool calls). Engine-agnostic on purpose: an
    engine compiles it to whatever it masks logits with (a grammar, a token mask).
    """

    #: the request field that asked for it, for an engine that cannot honour it (a 400)
    param: str
    json_schema: Mapping[str, Any] | None = None
    prefix: str = ""
    suffix: str = ""
    repeat: bool = False
    separator: str = ""


CONSTRAINED_DECODING: Final = "constrained_decoding"
"""The feature an engine declares when it honours ``PreprocessedRequest.constraint``."""


@dataclass(slots=True, frozen=True, kw_only=True)
class ReasoningBudget:
    """At most ``tokens`` reasoning tokens per choice: past them the engine makes the model
    end its reasoning by forcing its end marker (``end``), one token a step.

    The markers are the model's reasoning format's (the parser's, ``--reasoning-parser``),
    as token ids of the model's own tokenizer, so an engine needs no parser and no text to
    count: tokens after ``start`` (or from the first one, when the prompt leaves the
    reasoning ``open``) are reasoning until ``end``. A choice may reason more than once; the
    budget is for all of it together. :mod:`operators.engines._reasoning_budget` counts.
    """

    #: the request field that asked (``thinking_token_budget``, ``reasoning_effort``), for
    #: an engine that cannot end reasoning (a 400 naming it)
    param: str
    #: the most reasoning tokens a choice may generate
    tokens: int
    #: the end marker's ids: forced, in order, once the budget is spent
    end: tuple[int, ...]
    #: the start marker's ids (empty: reasoning only where the prompt leaves it open)
    start: tuple[int, ...] = ()
    #: whether the model starts inside its reasoning (the template opened it)
    open: bool = False


REASONING_BUDGET: Final = "reasoning_budget"
"""The feature an engine declares when it honours ``PreprocessedRequest.reasoning_budget``
(it can force the end marker's tokens)."""


LORA: Final = "lora"
"""The feature an engine declares when it runs requests with adapters
(``PreprocessedRequest.lora``) and loads them: it is then a :class:`LoraEngine`."""


class LoraEngine(Protocol):
    """An engine that runs requests with adapters (LoRA) of its model, by name."""

    @property
    def loras(self) -> Mapping[str, str]:
        """The adapters loaded now: name -> where from (a live view)."""
        ...

    async def load_lora(self, name: str, path: str, /) -> None:
        """Load the adapter at ``path`` as ``name``.

        Raises:
            InvalidRequest: the name is taken, or the file is no adapter of this model
                (``param`` names the field at fault: ``lora_name``, ``lora_path``).
        """
        ...

    async def unload_lora(self, name: str, /) -> None:
        """Forget the adapter ``name``: new requests cannot name it; running ones finish.

        Raises:
            KeyError: no adapter of that name is loaded.
        """
        ...


def lora_engine_of(engine: object) -> LoraEngine | None:
    """``engine`` if it declares :data:`LORA` (and so runs and loads adapters), else None."""
    return engine if LORA in engine_features(engine) else None  # type: ignore[return-value]


class HasFeatures(Protocol):
    """An engine that declares what it supports beyond the base contract."""

    @property
    def features(self) -> frozenset[str]: ...


def engine_features(engine: object) -> frozenset[str]:
    """What ``engine`` declares it supports (``engine.features``); nothing if undeclared.

    An engine that does not declare a feature is assumed not to have it: a user's engine
    that knows nothing of constraints would otherwise ignore them and answer as if it had
    honoured them.
    """
    features = getattr(engine, "features", None)
    return frozenset(features) if features is not None else frozenset()


class Embedder(Protocol):
    """An engine that also embeds (the optional part of the engine contract,
    ``docs/engines.md``): ``/v1/embeddings`` calls it with each input's token ids."""

    async def embed(self, token_ids: Sequence[Sequence[int]], /) -> list[list[float]]:
        """One vector per input, all of one length; deterministic, and the same vector for
        an input alone or in any batch. An input it cannot take raises
        ``InvalidRequest(param="input.<i>")``."""
        ...


def embedder_of(engine: object) -> Embedder | None:
    """``engine`` if it embeds (has an ``embed`` method), else None."""
    return engine if callable(getattr(engine, "embed", None)) else None  # type: ignore[return-value]


@dataclass(slots=True, kw_only=True)
class PreprocessedRequest:
    """A tokenized request, the shape every operator after the preprocessor speaks."""

    #: the prompt's token ids (on a migration retry: prompt + the output replayed so far)
    token_ids: list[int]
    stop: StopConditions = field(default_factory=StopConditions)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    #: the model name the client asked for
    model: str = ""
    #: number of choices
    n: int = 1
    #: how many trailing ``token_ids`` are replayed output, not prompt (set by Migration)
    replayed_tokens: int = 0
    multimodal: tuple[MultimodalItem, ...] = ()
    #: the encode worker's result for ``multimodal`` (an object), once computed
    encoder_result: dict[str, Any] | None = None
    #: the prefill worker's transfer handle for the decode worker (an object)
    prefill_result: dict[str, Any] | None = None
    #: the tools whose calls a tool-call parser turns into ``tool_calls`` (empty: none,
    #: also when the client said ``tool_choice: "none"``)
    tools: tuple[Tool, ...] = ()
    #: what every choice's output must match (``response_format``, a required tool call);
    #: an engine that cannot honour it raises ``InvalidRequest(param=constraint.param)``
    constraint: Constraint | None = None
    #: the scheduling priority: lower runs earlier (vLLM's convention); engines and
    #: routers admit waiting requests by priority, then arrival, with aging
    #: (:mod:`pipeline.priority`)
    priority: int = 0
    #: the adapter (LoRA) to run with, by name (None: the base model)
    lora: str | None = None
    #: how many tokens each choice may reason (None: as many as it likes); an engine that
    #: cannot end reasoning raises ``InvalidRequest(param=reasoning_budget.param)``
    reasoning_budget: ReasoningBudget | None = None
    #: the conversation it belongs to (OpenAI's ``prompt_cache_key``, the
    #: ``x-session-affinity`` header): a KV router keeps a conversation on one worker while
    #: that worker's load allows, a remote engine passes it on to its server
    affinity: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """How many of ``token_ids`` are the user's prompt."""
        return len(self.token_ids) - self.replayed_tokens


@dataclass(slots=True)
class EngineOutput:
    """One step of an engine for one choice: usually one token, a burst when speculating.

    Not keyword-only, unlike the request types: one is built per token, and a positional
    call costs half a keyword one. The field order is therefore part of the API.
    """

    token_ids: list[int]
    #: the sampled tokens' logprobs, aligned with ``token_ids`` (when asked for)
    logprobs: list[float] | None = None
    #: the best alternatives at each position, aligned with ``token_ids`` (when asked for)
    top_logprobs: list[TopLogprobs] | None = None
    finish_reason: FinishReason | None = None
    #: which choice (0 .. n-1)
    index: int = 0
    #: text for ``token_ids`` when the engine decodes itself (then the Backend skips decoding)
    text: str | None = None
    #: an encode worker's result (an object), on its terminal output
    encoder_result: dict[str, Any] | None = None
    #: a prefill worker's transfer handle (an object), on its terminal output
    prefill_result: dict[str, Any] | None = None
    #: prompt tokens the engine found in its prefix cache instead of computing them, on an
    #: attempt's first output (None: not reported); shown as the response's
    #: ``usage.prompt_tokens_details.cached_tokens``
    cached_tokens: int | None = None


@dataclass(slots=True)
class BackendOutput:
    """One step of the Backend for one choice: token ids with their text, and what to show.

    Positional construction is allowed for the same reason as :class:`EngineOutput`.

    ``token_ids`` is the exact record of what the engine generated in this step (every
    generated id appears in exactly one output), and ``tokens[i]`` is the text of
    ``token_ids[i]``; withholding never moves text between positions. ``text`` is what the
    client may see now: the generated text minus whatever is withheld because it may still
    become a hidden stop string, plus withheld text released by this step.
    """

    token_ids: list[int]
    #: text of each token id, aligned with ``token_ids`` ("" while a character is incomplete)
    tokens: list[str]
    #: what the client may see now
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    finish_reason: FinishReason | None = None
    #: what stopped the choice: the stop string or the user's stop token id
    stop_reason: str | int | None = None
    index: int = 0
    #: how many of this choice's tokens so far are delivered (their text, or part of it,
    #: has reached the client); tokens never delivered were swallowed by a hidden stop
    delivered_tokens: int = 0
    #: reasoning text the client may see now (a reasoning parser moved it out of ``text``)
    reasoning: str = ""
    #: tool-call pieces the client may see now (a tool-call parser moved them out of ``text``)
    tool_calls: list[ToolCallDelta] | None = None


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call of one choice, as OpenAI streams it.

    A call's first piece names it (``id``, ``name``, ``arguments`` ""); later pieces carry
    fragments of its arguments' JSON text. ``index`` numbers the calls of a choice.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None
