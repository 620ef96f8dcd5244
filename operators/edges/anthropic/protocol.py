"""The body of ``POST /v1/messages`` (and ``/count_tokens``): JSON becomes a
:class:`MessagesRequest`.

Anthropic's Messages API, as far as a self-hosted model can honour it: ``model``,
``max_tokens`` (required, as Anthropic requires it), ``messages`` (``user`` and
``assistant`` turns, string content or blocks: ``text``, ``image`` (base64 or URL),
``tool_use``, ``tool_result``, and ``thinking`` blocks handed back), ``system`` (a string
or text blocks), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``,
``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``,
``any``, ``tool`` with ``name``, ``none``; ``disable_parallel_tool_use``) and
``metadata``. What the API has and this server cannot do (server tools such as web search,
``container``, ``mcp_servers``, extended ``thinking`` budgets, documents, a final
assistant turn to continue) is a 400 naming the field. Integers are bounded as on every
edge (:data:`~operators.edges.openai.protocol.base.MAX_INT`).
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
    invalid,
)
from operators.edges.openai.protocol.parsing import from_validation_error
from operators.edges.openai.protocol.requests import MAX_STOP_STRINGS
from pipeline import InvalidRequest

__all__ = (
    "Base64Source",
    "CountTokensRequest",
    "ImageBlock",
    "MessageParam",
    "MessagesRequest",
    "TextBlock",
    "ThinkingBlock",
    "Tool",
    "ToolChoice",
    "ToolResultBlock",
    "ToolUseBlock",
    "UrlSource",
    "parse_count_tokens_request",
    "parse_messages_request",
    "refuse_unsupported",
)

#: OpenAI's rule for function names, which Anthropic's tool names also follow
_NAME_PATTERN: Final = r"^[A-Za-z0-9_.\-]{1,64}$"


class TextBlock(Model):
    """``{"type": "text", "text": ...}`` (``cache_control`` and citations are accepted:
    the server caches prefixes by itself)."""

    type: Literal["text"]
    text: str


class Base64Source(Model):
    """An image's bytes, base64-encoded."""

    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(Model):
    """An image by URL (fetched only from the hosts the server allows)."""

    type: Literal["url"]
    url: str


def _kind_of_source(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"{kind}_source" if kind in ("base64", "url") else None


_Source = Annotated[
    Annotated[Base64Source, Tag("base64_source")] | Annotated[UrlSource, Tag("url_source")],
    Discriminator(
        _kind_of_source,
        custom_error_type="invalid_source",
        custom_error_message="an image source must be base64 or url (files are not supported)",
    ),
]


class ImageBlock(Model):
    """``{"type": "image", "source": ...}``."""

    type: Literal["image"]
    source: _Source

    @property
    def url(self) -> str:
        """The image as a URL (``data:`` for base64)."""
        source = self.source
        if isinstance(source, Base64Source):
            return f"data:{source.media_type};base64,{source.data}"
        return source.url


class ToolUseBlock(Model):
    """An assistant's earlier call, handed back."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]


def _kind_of_result_block(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"{kind}_block" if kind in ("text", "image") else None


_ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text_block")] | Annotated[ImageBlock, Tag("image_block")],
    Discriminator(
        _kind_of_result_block,
        custom_error_type="invalid_block",
        custom_error_message="a tool_result's content blocks must be text or image",
    ),
]


def _kind_of_text(value: Any) -> str | None:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "blocks"
    return None


class ToolResultBlock(Model):
    """What a call returned (in a user turn)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: (
        Annotated[
            Annotated[str, Tag("string")] | Annotated[list[_ResultBlock], Tag("blocks")],
            Discriminator(
                _kind_of_text,
                custom_error_type="invalid_content",
                custom_error_message="content must be a string or an array of blocks",
            ),
        ]
        | None
    ) = None
    is_error: Bool = False


class ThinkingBlock(Model):
    """An assistant's earlier thinking, handed back (not shown to the model again)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _kind_of_block(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "image", "tool_use", "tool_result"):
        return f"{kind}_block"
    if kind in ("thinking", "redacted_thinking"):
        return "thinking_block"
    return None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text_block")]
    | Annotated[ImageBlock, Tag("image_block")]
    | Annotated[ToolUseBlock, Tag("tool_use_block")]
    | Annotated[ToolResultBlock, Tag("tool_result_block")]
    | Annotated[ThinkingBlock, Tag("thinking_block")],
    Discriminator(
        _kind_of_block,
        custom_error_type="invalid_block",
        custom_error_message=(
            "a content block must be text, image, tool_use, tool_result or thinking "
            "(documents and server tool blocks are not supported)"
        ),
    ),
]


class MessageParam(Model):
    """One turn: the user's or the assistant's."""

    role: Literal["user", "assistant"]
    content: Annotated[
        Annotated[str, Tag("string")] | Annotated[list[ContentBlock], Tag("blocks")],
        Discriminator(
            _kind_of_text,
            custom_error_type="invalid_content",
            custom_error_message="content must be a string or an array of content blocks",
        ),
    ]


class Tool(Model):
    """A client tool: its name, description and the JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Model):
    """``tool_choice``: ``auto``, ``any`` (some tool), ``tool`` (the one named), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise invalid("tool_choice.name", "tool_choice of type 'tool' needs a 'name'")
        return self


def _kind_of_system(value: Any) -> str | None:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "blocks"
    return None


_System = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[TextBlock], Tag("blocks")],
    Discriminator(
        _kind_of_system,
        custom_error_type="invalid_system",
        custom_error_message="system must be a string or an array of text blocks",
    ),
]


class CountTokensRequest(Model):
    """The body of ``POST /v1/messages/count_tokens``: a Messages request without the
    generation settings."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: _System | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _fits_together(self) -> CountTokensRequest:
        names = [tool.name for tool in self.tools or ()]
        for position, name in enumerate(names):
            if name in names[:position]:
                raise invalid(f"tools.{position}", f"two tools are named '{name}'")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool"):
            if not names:
                raise invalid("tool_choice", f"tool_choice '{choice.type}' needs 'tools'")
            if choice.type == "tool" and choice.name not in names:
                raise invalid(
                    "tool_choice.name",
                    f"tool_choice names the tool '{choice.name}', which is not one of 'tools' "
                    f"({', '.join(names)})",
                )
        if self.messages[-1].role == "assistant":
            raise invalid(
                "messages",
                "a final assistant turn (prefilling the answer) is not supported: end with a "
                "user turn",
            )
        return self

    @property
    def system_text(self) -> str | None:
        """The system prompt as one string (text blocks joined by newlines)."""
        system = self.system
        if system is None or isinstance(system, str):
            return system
        return "\n".join(block.text for block in system)


class MessagesRequest(CountTokensRequest):
    """The body of ``POST /v1/messages``."""

    max_tokens: Count
    stop_sequences: list[str] | None = None
    temperature: Float | None = Field(default=None, ge=0, le=1)
    top_p: Float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, strict=True, ge=0, le=MAX_INT)
    stream: Bool = False
    metadata: dict[str, Any] | None = None
    #: lower runs earlier (None: the API key's default priority, else 0); not Anthropic's
    #: own field: the clients send it in ``extra_body``
    priority: Priority | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, stops: list[str] | None) -> list[str] | None:
        if stops is None:
            return None
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if "" in stops:
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def user(self) -> str | None:
        """``metadata.user_id``."""
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None


# ------------------------------------------------------------------ the unsupported fields


def _truthy(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


def _thinking(value: Any) -> bool:
    return _truthy(value) and not (isinstance(value, dict) and value.get("type") == "disabled")


def _not(*accepted: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value not in accepted


#: field -> (does this value ask for something we do not do?, what to tell the client)
UNSUPPORTED: Final[Mapping[str, tuple[Callable[[Any], bool], str]]] = {
    "thinking": (
        _thinking,
        "extended thinking with a budget is not supported (a model that reasons shows its "
        "thinking blocks anyway)",
    ),
    "container": (_truthy, "containers are not supported"),
    "mcp_servers": (_truthy, "MCP servers are not supported"),
    "context_management": (_truthy, "context management is not supported"),
    "service_tier": (_not("auto", "standard_only"), "only service_tier 'auto' is supported"),
}


def refuse_unsupported(data: Mapping[str, Any]) -> None:
    """Raise for the first field that asks for what this server cannot do.

    Raises:
        InvalidRequest: ``param`` names the field.
    """
    for name, (asks, message) in UNSUPPORTED.items():
        if name in data and asks(data[name]):
            raise InvalidRequest(message, param=name)
    for position, tool in enumerate(data.get("tools") or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise InvalidRequest(
                f"tools.{position} is a {kind!r} server tool: only client tools (name, "
                "description, input_schema) are supported",
                param=f"tools.{position}.type",
            )


def _parse(model: type[CountTokensRequest], body: bytes | str | dict[str, Any]) -> Any:
    data: Any = body
    if not isinstance(body, dict):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"could not parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {type(data).__name__}")
    refuse_unsupported(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, _FIELDS) from exc


def parse_messages_request(body: bytes | str | dict[str, Any]) -> MessagesRequest:
    """Validate a ``/v1/messages`` body.

    Raises:
        InvalidRequest: malformed JSON, an unsupported or invalid field (``param``).
    """
    request: MessagesRequest = _parse(MessagesRequest, body)
    return request


def parse_count_tokens_request(body: bytes | str | dict[str, Any]) -> CountTokensRequest:
    """Validate a ``/v1/messages/count_tokens`` body.

    Raises:
        InvalidRequest: malformed JSON, an unsupported or invalid field (``param``).
    """
    request: CountTokensRequest = _parse(CountTokensRequest, body)
    return request


_FIELDS: Final = frozenset(
    name
    for model in (
        MessagesRequest,
        MessageParam,
        TextBlock,
        ImageBlock,
        Base64Source,
        UrlSource,
        ToolUseBlock,
        ToolResultBlock,
        ThinkingBlock,
        Tool,
        ToolChoice,
    )
    for name in model.model_fields
)
