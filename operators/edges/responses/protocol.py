"""The body of ``POST /v1/responses``: untrusted JSON becomes a :class:`ResponsesRequest`.

OpenAI's Responses API, as far as a self-hosted model can honour it: ``input`` (a string,
or items: ``message`` with ``input_text`` / ``input_image`` parts, ``function_call``,
``function_call_output``, and ``reasoning`` items handed back), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``store``,
``previous_response_id``, function ``tools`` (the flat shape: ``{type, name, description,
parameters, strict}``), ``tool_choice``, ``parallel_tool_calls``, ``text.format``
(``text``, ``json_object``, ``json_schema``), ``top_logprobs`` with ``include:
["message.output_text.logprobs"]``, ``truncation`` (``auto``: the oldest items after the
instructions are dropped until the conversation fits), ``reasoning`` (``effort`` as chat's
``reasoning_effort``; ``summary`` accepted: see :class:`ReasoningConfig`), ``metadata``,
``user``, ``safety_identifier`` and the prompt cache's hints. vLLM's extensions come
through ``extra_body`` as on the chat endpoint: ``stop``, ``seed``, ``top_k``,
``min_tokens``, ``ignore_eos``.

What the API has and this server cannot do (built-in tools such as web search,
``background``, stored ``prompt`` templates, ``conversation`` objects, moderation...) is a
400 naming the field (:data:`UNSUPPORTED`, and :func:`~operators.edges.http.schema.refused`
for nested ones: ``text.verbosity``, ``reasoning.mode``), never silently ignored. Integers
are bounded as on the chat endpoint (:data:`~operators.edges.http.schema.MAX_INT`): a 400,
never a 500.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from operators.edges.http.schema import (
    ARRAY,
    MAX_INT,
    NOTHING,
    OBJECT,
    STRING,
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
    Unsupported,
    by_shape,
    by_type,
    invalid,
    kind,
    parse_body,
    refused,
    unique_names,
)
from operators.edges.openai.protocol.requests import MAX_LOGPROBS, ReasoningEffort
from operators.edges.openai.unsupported import (
    ALLOWED_CALLERS,
    DEFER_LOADING,
    SERVICE_TIER,
    VERBOSITY,
)

__all__ = (
    "LOGPROBS_INCLUDE",
    "UNSUPPORTED",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "ImagePart",
    "InputItem",
    "MessageItem",
    "NamedFunctionChoice",
    "ReasoningConfig",
    "ReasoningItem",
    "RefusalPart",
    "ResponsesRequest",
    "ResponsesStreamOptions",
    "TextConfig",
    "TextFormatSpec",
    "TextPart",
    "parse_responses_request",
)

#: the ``include`` value that asks for the output text's logprobs
LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"
#: OpenAI's rule for function and schema names
_NAME_PATTERN: Final = r"^[A-Za-z0-9_.\-]{1,64}$"


# ------------------------------------------------------------------------------ content


class TextPart(Model):
    """``input_text`` (a user's) or ``output_text`` (an assistant's, handed back)."""

    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(Model):
    """An assistant's ``refusal`` part, handed back."""

    type: Literal["refusal"]
    refusal: str


class ImagePart(Model):
    """``input_image``: by URL (``data:`` URLs, or hosts the server may fetch)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _by_url(self) -> ImagePart:
        if self.file_id is not None:
            raise invalid("file_id", "images by 'file_id' are not supported (no file store)")
        if self.image_url is None:
            raise invalid("image_url", "an 'input_image' part needs an 'image_url'")
        return self


ContentPart = Annotated[
    Annotated[TextPart, kind("text")]
    | Annotated[RefusalPart, kind("refusal")]
    | Annotated[ImagePart, kind("image")],
    by_type(
        "a content part must be input_text, output_text, refusal or input_image "
        "(input_file and input_audio are not supported)",
        {"input_text": "text", "output_text": "text", "refusal": "refusal", "input_image": "image"},
        error="invalid_content_part",
    ),
]

_Content = Annotated[
    Annotated[str, kind(STRING)] | Annotated[list[ContentPart], kind(ARRAY)],
    by_shape(
        "content must be a string or an array of content parts",
        STRING,
        ARRAY,
        error="invalid_content",
    ),
]


# -------------------------------------------------------------------------------- items


class MessageItem(Model):
    """A message: the user's, the system's (or developer's), or an earlier answer."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: _Content
    id: str | None = None


class FunctionCallItem(Model):
    """A call the model made (from an earlier response), handed back."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(Model):
    """What a call returned: the result the model reads next."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: _Content
    id: str | None = None


class ReasoningItem(Model):
    """Reasoning from an earlier response, handed back: kept in the conversation's
    record, not shown to the model again (chat templates drop earlier reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[JsonObject] = Field(default_factory=list)
    content: list[JsonObject] | None = None


_ITEMS: Final = ("message", "function_call", "function_call_output", "reasoning")

InputItem = Annotated[
    Annotated[MessageItem, kind("message")]
    | Annotated[FunctionCallItem, kind("function_call")]
    | Annotated[FunctionCallOutputItem, kind("function_call_output")]
    | Annotated[ReasoningItem, kind("reasoning")],
    by_type(
        "an input item must be a message, function_call, function_call_output or "
        "reasoning item (item references and built-in tool items are not supported)",
        _ITEMS,
        untyped="message",  # OpenAI's "easy" input message: a role, no type
        error="invalid_input_item",
    ),
]


# -------------------------------------------------------------------------- tools, text


class FunctionTool(Model):
    """``tools[i]``: a function, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    parameters: JsonObject | None = None
    strict: Bool | None = None
    defer_loading: Annotated[Bool | None, refused(DEFER_LOADING)] = None
    allowed_callers: Annotated[list[str] | None, refused(ALLOWED_CALLERS)] = None
    async_: Annotated[
        Bool | None,
        refused(Unsupported("asynchronous function calls are not supported", NOTHING)),
    ] = Field(default=None, alias="async")
    output_schema: Annotated[
        JsonObject | None,
        refused(Unsupported("the model is not shown a tool's 'output_schema'", NOTHING)),
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _a_function(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else "function"
        if kind != "function":
            raise PydanticCustomError(
                "built_in_tool",
                "only function tools are supported (built-in tools such as web search, "
                "file search or code interpreter are not)",
            )
        return data


class NamedFunctionChoice(Model):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], kind(STRING)]
    | Annotated[NamedFunctionChoice, kind(OBJECT)],
    by_shape(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...} (built-in tools are not supported)',
        STRING,
        OBJECT,
        error="invalid_tool_choice",
    ),
]


class TextFormatSpec(Model):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=_NAME_PATTERN)
    schema_: JsonObject | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: Bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormatSpec:
        if self.type == "json_schema":
            if self.name is None:
                raise invalid("text.format.name", "a json_schema format needs a 'name'")
            if self.schema_ is None:
                raise invalid("text.format.schema", "a json_schema format needs a 'schema'")
        return self


class TextConfig(Model):
    """``text``: the output's format (and verbosity: only ``medium``, as on chat)."""

    format: TextFormatSpec | None = None
    verbosity: Annotated[Literal["low", "medium", "high"] | None, refused(VERBOSITY)] = None


_Summary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(Model):
    """``reasoning``: ``effort`` becomes chat's ``reasoning_effort`` (the chat template gets
    it, or a reasoning budget: :mod:`operators.edges.openai.reasoning`).

    ``summary`` (and the deprecated ``generate_summary``) is accepted, and no summary is
    made: every response's reasoning items carry what the model reasoned, whole, as
    ``content`` (``reasoning_text`` parts), and an empty ``summary``. The model's own
    reasoning is not a summary of it, so it is never put there; making one would take a
    second generation. The response's ``reasoning.summary`` is therefore null.
    """

    effort: ReasoningEffort | None = None
    summary: _Summary | None = None
    generate_summary: _Summary | None = None
    #: which earlier reasoning the model sees: none (chat templates drop it), as
    #: ``current_turn`` says; ``all_turns`` cannot be honoured
    context: Annotated[
        Literal["auto", "current_turn", "all_turns"] | None,
        refused(
            Unsupported(
                "earlier turns' reasoning is not shown to the model again (only 'current_turn')",
                (None, "auto", "current_turn"),
            )
        ),
    ] = None
    mode: Annotated[
        str | None,
        refused(Unsupported("only reasoning mode 'standard' is supported", (None, "standard"))),
    ] = None


class ResponsesStreamOptions(Model):
    """``stream_options``: OpenAI's padding of stream events against side channels (none
    is added here)."""

    include_obfuscation: Bool | None = None


_Input = Annotated[
    Annotated[str, kind(STRING)] | Annotated[list[InputItem], kind(ARRAY)],
    by_shape(
        "input must be a string or an array of input items", STRING, ARRAY, error="invalid_input"
    ),
]


class ResponsesRequest(Model):
    """The body of ``POST /v1/responses``."""

    model: str | None = None
    input: _Input
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: Float | None = Field(default=None, ge=0, le=2)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    stream: Bool = False
    store: Bool = True
    previous_response_id: str | None = Field(default=None, min_length=1)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    #: ``auto``: drop the oldest items (after the instructions) until the input fits
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    stream_options: ResponsesStreamOptions | None = None
    # Accepted, and change nothing about the answer (the engines cache prompt prefixes by
    # themselves); metadata is kept with the stored response.
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_options: JsonObject | None = None
    prompt_cache_retention: str | None = None
    # vLLM's extensions, through ``extra_body``
    stop: Stop | None = None
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**64)
    top_k: int | None = Field(default=None, strict=True, ge=0, le=MAX_INT)
    min_tokens: int = Field(default=0, strict=True, ge=0, le=MAX_INT)
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    #: lower runs earlier (None: the API key's default priority, else 0)
    priority: Priority | None = None
    #: the conversation: its requests stay on one worker while its load allows
    prompt_cache_key: ConversationKey | None = None

    @model_validator(mode="after")
    def _fits_together(self) -> ResponsesRequest:
        names = [tool.name for tool in self.tools or ()]
        unique_names(names, "tools")
        choice = self.tool_choice
        if choice is not None and choice not in ("none", "auto"):
            wanted = "'required'" if choice == "required" else "a named function"
            if not names:
                raise invalid("tool_choice", f"tool_choice {wanted} needs 'tools'")
            if isinstance(choice, NamedFunctionChoice) and choice.name not in set(names):
                raise invalid(
                    "tool_choice",
                    f"tool_choice names the function '{choice.name}', which is not one of "
                    f"'tools' ({', '.join(names)})",
                )
            fmt = self.text.format if self.text is not None else None
            if fmt is not None and fmt.type != "text":
                raise invalid(
                    "text.format",
                    f"'text.format' and tool_choice {wanted} cannot both constrain the output",
                )
        if self.max_output_tokens is not None and self.min_tokens > self.max_output_tokens:
            raise invalid(
                "min_tokens",
                f"'min_tokens' ({self.min_tokens}) exceeds 'max_output_tokens' "
                f"({self.max_output_tokens})",
            )
        for position, value in enumerate(self.include or ()):
            if value != LOGPROBS_INCLUDE:
                raise invalid(
                    f"include.{position}",
                    f"include {value!r} is not supported (only {LOGPROBS_INCLUDE!r})",
                )
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise invalid("input", "input must not be empty")
        if self.stream_options is not None and not self.stream:
            raise invalid(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the output text's logprobs were asked for."""
        return LOGPROBS_INCLUDE in (self.include or ())


# ------------------------------------------------------------------ the unsupported fields

#: field -> the rule: what the API has and this server cannot do
UNSUPPORTED: Final[Mapping[str, Unsupported]] = {
    "background": Unsupported("background responses are not supported", NOTHING),
    "prompt": Unsupported("stored prompt templates ('prompt') are not supported", NOTHING),
    "conversation": Unsupported(
        "conversation objects are not supported: use previous_response_id", NOTHING
    ),
    "max_tool_calls": Unsupported("'max_tool_calls' is not supported", NOTHING),
    "service_tier": SERVICE_TIER,
    "background_options": Unsupported("background responses are not supported", NOTHING),
    "context_management": Unsupported("context management (compaction) is not supported", NOTHING),
    "moderation": Unsupported("moderation is not supported", NOTHING),
    "access_programs": Unsupported("access programs are not supported", NOTHING),
    "image": Unsupported("request-level image options are not supported", NOTHING),
}


def parse_responses_request(body: bytes | str | Mapping[str, Any]) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body.

    Raises:
        InvalidRequest: malformed JSON, an unsupported or invalid field (``param``).
    """
    return parse_body(ResponsesRequest, body, unsupported=UNSUPPORTED)
