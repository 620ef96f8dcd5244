"""The body of ``POST /v1/responses``: untrusted JSON becomes a :class:`ResponsesRequest`.

OpenAI's Responses API, as far as a self-hosted model can honour it: ``input`` (a string,
or items: ``message`` with ``input_text`` / ``input_image`` parts, ``function_call``,
``function_call_output``, and ``reasoning`` items handed back), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``store``,
``previous_response_id``, function ``tools`` (the flat shape: ``{type, name, description,
parameters, strict}``), ``tool_choice``, ``parallel_tool_calls``, ``text.format``
(``text``, ``json_object``, ``json_schema``), ``top_logprobs`` with ``include:
["message.output_text.logprobs"]``, ``metadata`` and ``user``. vLLM's extensions come
through ``extra_body`` as on the chat endpoint: ``stop``, ``seed``, ``top_k``,
``min_tokens``, ``ignore_eos``.

What the API has and this server cannot do (built-in tools such as web search,
``background``, ``truncation: "auto"``, stored ``prompt`` templates, ``conversation``
objects, ``reasoning`` on a server without a reasoning parser...) is a 400 naming the
field (:func:`refuse_unsupported`), never silently ignored. Integers are bounded as on the
chat endpoint (:data:`~operators.edges.openai.protocol.base.MAX_INT`): a 400, never a 500.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from operators.edges.openai.protocol.base import (
    MAX_INT,
    Bool,
    Count,
    Float,
    Model,
    Priority,
    TokenId,
    invalid,
)
from operators.edges.openai.protocol.parsing import from_validation_error
from operators.edges.openai.protocol.requests import MAX_LOGPROBS, MAX_STOP_STRINGS
from pipeline import InvalidRequest

__all__ = (
    "LOGPROBS_INCLUDE",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "ImagePart",
    "InputItem",
    "MessageItem",
    "NamedFunctionChoice",
    "ReasoningItem",
    "RefusalPart",
    "ResponsesRequest",
    "TextConfig",
    "TextFormatSpec",
    "TextPart",
    "parse_responses_request",
    "refuse_unsupported",
)

#: the ``include`` value that asks for the output text's logprobs
LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"
#: OpenAI's limits on ``metadata``
_METADATA_KEYS: Final = 16
_METADATA_KEY_CHARS: Final = 64
_METADATA_VALUE_CHARS: Final = 512
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


def _kind_of_part(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("input_text", "output_text"):
        return "text_part"
    if kind == "refusal":
        return "refusal_part"
    if kind == "input_image":
        return "image_part"
    return None


ContentPart = Annotated[
    Annotated[TextPart, Tag("text_part")]
    | Annotated[RefusalPart, Tag("refusal_part")]
    | Annotated[ImagePart, Tag("image_part")],
    Discriminator(
        _kind_of_part,
        custom_error_type="invalid_content_part",
        custom_error_message=(
            "a content part must be input_text, output_text, refusal or input_image "
            "(input_file and input_audio are not supported)"
        ),
    ),
]


def _kind_of_content(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "parts"
    return None


_Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(
        _kind_of_content,
        custom_error_type="invalid_content",
        custom_error_message="content must be a string or an array of content parts",
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
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None


def _kind_of_item(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind is None and "role" in value:  # OpenAI's "easy" input message: no type
        return "message_item"
    if kind in ("message", "function_call", "function_call_output", "reasoning"):
        return f"{kind}_item"
    return None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message_item")]
    | Annotated[FunctionCallItem, Tag("function_call_item")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output_item")]
    | Annotated[ReasoningItem, Tag("reasoning_item")],
    Discriminator(
        _kind_of_item,
        custom_error_type="invalid_input_item",
        custom_error_message=(
            "an input item must be a message, function_call, function_call_output or "
            "reasoning item (item references and built-in tool items are not supported)"
        ),
    ),
]


# -------------------------------------------------------------------------- tools, text


class FunctionTool(Model):
    """``tools[i]``: a function, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class NamedFunctionChoice(Model):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


def _kind_of_choice(value: Any) -> str | None:
    if isinstance(value, str):
        return "mode"
    if isinstance(value, dict):
        return "named"
    return None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[NamedFunctionChoice, Tag("named")],
    Discriminator(
        _kind_of_choice,
        custom_error_type="invalid_tool_choice",
        custom_error_message=(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}'
        ),
    ),
]


class TextFormatSpec(Model):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=_NAME_PATTERN)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
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
    """``text``: the output's format (and verbosity, which only ``medium`` honours)."""

    format: TextFormatSpec | None = None
    verbosity: Literal["medium"] | None = None


def _kind_of_input(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "items"
    return None


_Input = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
    Discriminator(
        _kind_of_input,
        custom_error_type="invalid_input",
        custom_error_message="input must be a string or an array of input items",
    ),
]


def _kind_of_stop(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "texts"
    return None


_Stop = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[str], Tag("texts")],
    Discriminator(
        _kind_of_stop,
        custom_error_type="invalid_stop",
        custom_error_message="stop must be a string or an array of strings",
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
    metadata: dict[str, str] | None = None
    user: str | None = None
    #: ``{"effort": ...}``: accepted only when the server parses reasoning
    reasoning: dict[str, Any] | None = None
    # vLLM's extensions, through ``extra_body``
    stop: _Stop | None = None
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**64)
    top_k: int | None = Field(default=None, strict=True, ge=0, le=MAX_INT)
    min_tokens: int = Field(default=0, strict=True, ge=0, le=MAX_INT)
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    #: lower runs earlier (None: the API key's default priority, else 0)
    priority: Priority | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("metadata")
    @classmethod
    def _metadata_fits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > _METADATA_KEYS:
            raise ValueError(f"at most {_METADATA_KEYS} metadata keys are allowed")
        for key, value in metadata.items():
            if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata keys hold at most {_METADATA_KEY_CHARS} characters and "
                    f"values at most {_METADATA_VALUE_CHARS}"
                )
        return metadata

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if "" in stops:
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _fits_together(self) -> ResponsesRequest:
        names = [tool.name for tool in self.tools or ()]
        for position, name in enumerate(names):
            if name in names[:position]:
                raise invalid(f"tools.{position}", f"two tools are named '{name}'")
        choice = self.tool_choice
        if choice is not None and choice not in ("none", "auto"):
            wanted = "'required'" if choice == "required" else "a named function"
            if not names:
                raise invalid("tool_choice", f"tool_choice {wanted} needs 'tools'")
            if isinstance(choice, NamedFunctionChoice) and choice.name not in names:
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
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the output text's logprobs were asked for."""
        return LOGPROBS_INCLUDE in (self.include or ())


# ------------------------------------------------------------------ the unsupported fields


def _truthy(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


def _not(*accepted: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value not in accepted


#: field -> (does this value ask for something we do not do?, what to tell the client)
UNSUPPORTED: Final[Mapping[str, tuple[Callable[[Any], bool], str]]] = {
    "background": (_truthy, "background responses are not supported"),
    "prompt": (_truthy, "stored prompt templates ('prompt') are not supported"),
    "conversation": (_truthy, "conversation objects are not supported: use previous_response_id"),
    "truncation": (_not("disabled"), "only truncation 'disabled' is supported"),
    "max_tool_calls": (_truthy, "'max_tool_calls' is not supported"),
    "service_tier": (_not("auto", "default"), "only service_tier 'auto' is supported"),
}


def refuse_unsupported(data: Mapping[str, Any], *, reasoning: bool) -> None:
    """Raise for the first field of a body that asks for what this server cannot do.

    ``reasoning``: whether the server parses reasoning (then ``reasoning.effort`` is
    accepted: the model reasons as it always does).

    Raises:
        InvalidRequest: ``param`` names the field.
    """
    for name, (asks, message) in UNSUPPORTED.items():
        if name in data and asks(data[name]):
            raise InvalidRequest(message, param=name)
    for position, tool in enumerate(data.get("tools") or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(
                f"tools.{position} is a {kind!r} tool: only function tools are supported "
                "(built-in tools such as web search, file search or code interpreter are "
                "not)",
                param="tools",
            )
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise InvalidRequest(
            f"tool_choice {choice.get('type')!r} names a built-in tool, which is not supported",
            param="tool_choice",
        )
    effort = data.get("reasoning")
    if _truthy(effort):
        if not reasoning:
            raise InvalidRequest(
                "this model does not reason ('reasoning' needs a server started with "
                "--reasoning-parser)",
                param="reasoning",
            )
        if isinstance(effort, dict) and _truthy(effort.get("summary")):
            raise InvalidRequest("reasoning summaries are not supported", param="reasoning.summary")
    verbosity = (
        (data.get("text") or {}).get("verbosity") if isinstance(data.get("text"), dict) else None
    )
    if verbosity not in (None, "medium"):
        raise InvalidRequest("only text.verbosity 'medium' is supported", param="text.verbosity")


def parse_responses_request(
    body: bytes | str | dict[str, Any], *, reasoning: bool = False
) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body.

    Raises:
        InvalidRequest: malformed JSON, an unsupported or invalid field (``param``).
    """
    data: Any = body
    if not isinstance(body, dict):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"could not parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {type(data).__name__}")
    refuse_unsupported(data, reasoning=reasoning)
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, _FIELDS) from exc


_FIELDS: Final = frozenset(
    name
    for model in (
        ResponsesRequest,
        MessageItem,
        FunctionCallItem,
        FunctionCallOutputItem,
        ReasoningItem,
        TextPart,
        RefusalPart,
        ImagePart,
        FunctionTool,
        NamedFunctionChoice,
        TextConfig,
        TextFormatSpec,
    )
    for name in model.model_fields
) | {"schema"}
