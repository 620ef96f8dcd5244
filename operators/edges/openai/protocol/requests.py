"""The request bodies: the fields chat and completions share, and their hot-path conversions.

:class:`GenerationRequest` turns the generation fields into the records of
:mod:`operators.contracts.llm` (:meth:`GenerationRequest.stop_conditions`, ``sampling_options()``,
``output_options()``); :class:`ChatCompletionRequest` and :class:`CompletionRequest` add
what only their endpoint has.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, model_validator

from operators.contracts.llm import OutputOptions, SamplingOptions, StopConditions
from operators.edges.http.schema import (
    ARRAY,
    ARRAYS,
    MAX_INT,
    MAX_STOP_STRINGS,
    STRING,
    STRINGS,
    Bool,
    ConversationKey,
    Count,
    Float,
    JsonObject,
    Metadata,
    Model,
    Priority,
    Stop,
    TokenId,
    by_shape,
    invalid,
    kind,
    unique_names,
)

from .messages import ChatMessage
from .tools import (
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    ToolChoice,
    ToolDefinition,
)

__all__ = (
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "ChatCompletionRequest",
    "ReasoningEffort",
    "CompletionRequest",
    "GenerationRequest",
    "StreamOptions",
)

#: most choices one request may ask for
MAX_N: Final = 128
#: most alternatives per position (chat ``top_logprobs``, completions ``logprobs``)
MAX_LOGPROBS: Final = 20


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""How much a reasoning model should reason (OpenAI's values, and vLLM's ``max``)."""


class StreamOptions(Model):
    """``stream_options``: only allowed with ``stream: true``."""

    include_usage: Bool = False
    #: OpenAI's padding of stream events against side channels: none is added here
    include_obfuscation: Bool | None = None


class GenerationRequest(Model):
    """The fields chat and completions requests share, and their hot-path conversions."""

    #: the model the client asked for (echoed back in responses); optional here
    model: str | None = None
    n: int = Field(default=1, strict=True, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    stop: Stop | None = None
    temperature: Float | None = Field(default=None, ge=0, le=2)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**64)
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # Extensions (vLLM's names), sent by OpenAI clients through ``extra_body``.
    min_tokens: int = Field(default=0, strict=True, ge=0, le=MAX_INT)
    #: (also Anthropic's field) the k most likely tokens only (0 or -1: all of them)
    top_k: int | None = Field(default=None, strict=True, ge=-1, le=MAX_INT)
    min_p: Float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: Float | None = Field(default=None, gt=0, le=2)
    ignore_eos: Bool = False
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    stop_token_ids: list[TokenId] | None = None
    #: lower runs earlier (None: the API key's default priority, else 0)
    priority: Priority | None = None
    #: the conversation (OpenAI's name): its requests stay on one worker while its load
    #: allows (None: the ``x-session-affinity`` header's, if any)
    prompt_cache_key: ConversationKey | None = None

    @model_validator(mode="after")
    def _check_combinations(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise invalid(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        max_tokens, param = self.requested_max_tokens
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise invalid(
                "min_tokens", f"'min_tokens' ({self.min_tokens}) exceeds '{param}' ({max_tokens})"
            )
        return self

    # ---------------------------------------------------------------- derived values

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The client's output-length limit and the name of the field that set it."""
        return self.max_tokens, "max_tokens"

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def logprobs_count(self) -> int | None:
        """None: no logprobs; k: the sampled token's logprob and k alternatives."""
        return None

    def stop_conditions(
        self, *, max_tokens: int | None, eos_token_ids: tuple[int, ...]
    ) -> StopConditions:
        """The request's stop rules; ``max_tokens`` already resolved against the model."""
        stop = self.stop
        if isinstance(stop, str):  # only when built without validation
            stop = [stop]
        return StopConditions(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=() if stop is None else tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            eos_token_ids=eos_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
        )

    def sampling_options(self) -> SamplingOptions:
        """Sampling parameters for the engine."""
        return SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )

    def output_options(self) -> OutputOptions:
        """What the client wants besides text."""
        return OutputOptions(
            logprobs=self.logprobs_count, skip_special_tokens=self.skip_special_tokens
        )


class ChatCompletionRequest(GenerationRequest):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    #: the newer name of ``max_tokens``; wins when both are given
    max_completion_tokens: Count | None = None
    logprobs: Bool = False
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    #: functions the model may call
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    #: False: at most one call per answer (default: several allowed)
    parallel_tool_calls: Bool | None = None
    response_format: ResponseFormat | None = None
    #: how much a reasoning model reasons: the chat template gets it (``reasoning_effort``,
    #: and ``enable_thinking`` false for ``none``); where the template does not read it, a
    #: reasoning budget (:mod:`operators.edges.openai.reasoning`)
    reasoning_effort: ReasoningEffort | None = None
    #: (vLLM's extension) the most tokens each choice may reason; past them the engine ends
    #: the reasoning (:class:`~operators.contracts.llm.ReasoningBudget`)
    thinking_token_budget: int | None = Field(default=None, strict=True, ge=0, le=MAX_INT)
    # Accepted, and change nothing about the answer (a chat completion is not kept; the
    # engines cache prompt prefixes by themselves).
    metadata: Metadata | None = None
    store: Bool | None = None
    safety_identifier: str | None = None
    prompt_cache_options: JsonObject | None = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        return self

    @model_validator(mode="after")
    def _tools_fit_together(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        unique_names(names, "tools")
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return self
        wanted = "'required'" if choice == "required" else "a named function"
        if not names:
            raise invalid("tool_choice", f"tool_choice {wanted} needs 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in set(names):
            raise invalid(
                "tool_choice",
                f"tool_choice names the function '{choice.function.name}', which is not "
                f"one of 'tools' ({', '.join(names)})",
            )
        if isinstance(self.response_format, JsonObjectFormat | JsonSchemaFormat):
            raise invalid(
                "response_format",
                f"'response_format' and tool_choice {wanted} cannot both constrain the output",
            )
        return self

    @property
    def effective_tool_choice(self) -> str:
        """``"none"``, ``"auto"``, ``"required"`` or ``"named"``: what the tools are for.

        OpenAI's defaults: ``"auto"`` when tools are given, ``"none"`` otherwise.
        """
        if not self.tools:
            return "none"
        choice = self.tool_choice
        if choice is None:
            return "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    @property
    def called_tools(self) -> list[ToolDefinition]:
        """The tools a call may name: all of them, or the one ``tool_choice`` names."""
        choice = self.tool_choice
        tools = self.tools or []
        if isinstance(choice, NamedToolChoice):
            return [tool for tool in tools if tool.function.name == choice.function.name]
        return tools

    @property
    def truncation_keep(self) -> int | None:
        """How many leading messages a conversation too long for the context keeps while
        the ones after them are dropped, oldest first, until it fits (None: never
        truncated, a 400; only the Responses API's ``truncation: "auto"`` truncates)."""
        return None

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_Prompt = Annotated[
    Annotated[str, kind(STRING)]
    | Annotated[list[str], kind(STRINGS), Field(min_length=1)]
    | Annotated[list[TokenId], kind(ARRAY), Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], kind(ARRAYS), Field(min_length=1)
    ],
    by_shape(
        "prompt must be a string, an array of strings, an array of token ids "
        "or an array of arrays of token ids",
        STRING,
        STRINGS,
        ARRAY,
        ARRAYS,
        error="invalid_prompt",
    ),
]


class CompletionRequest(GenerationRequest):
    """The body of ``POST /v1/completions``.

    A prompt that is a list of strings or a list of token-id lists is a batch: each prompt
    gets ``n`` choices, numbered ``prompt_index * n + i``.
    """

    prompt: _Prompt
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise invalid(
                "echo", "'echo' together with 'logprobs' is not supported (no prompt logprobs)"
            )
        if self.suffix:
            raise invalid("suffix", "'suffix' (insertion) is not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not isinstance(prompt[0], str | list):
            return [prompt]
        return list(prompt)

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs
