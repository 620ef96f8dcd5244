"""The body of ``POST /v1/messages`` (and ``/count_tokens``): JSON becomes a
:class:`MessagesRequest`.

Anthropic's Messages API, as far as a self-hosted model can honour it: ``model``,
``max_tokens`` (required, as Anthropic requires it), ``messages`` (``user`` and
``assistant`` turns, string content or blocks: ``text``, ``image`` (base64 or URL),
``tool_use``, ``tool_result``, and ``thinking`` blocks handed back), ``system`` (a string
or text blocks), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``,
``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``,
``any``, ``tool`` with ``name``, ``none``; ``disable_parallel_tool_use``), ``metadata``
and ``thinking`` (:class:`ThinkingConfig`: a budget the engine enforces, reasoning turned
off through the chat template, or the model's own way). What the API has and this server
cannot do (server tools such as web search, ``container``, ``mcp_servers``, documents,
``output_config``, a final assistant turn to continue) is a 400 naming the field. Integers
are bounded as on every edge (:data:`~operators.edges.http.schema.MAX_INT`).
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
    STRING,
    Bool,
    Count,
    Float,
    JsonObject,
    Model,
    Priority,
    StopList,
    Unsupported,
    by_shape,
    by_type,
    invalid,
    kind,
    parse_body,
    refused,
    unique_names,
)
from operators.edges.openai.unsupported import ALLOWED_CALLERS, DEFER_LOADING

__all__ = (
    "Base64Source",
    "CountTokensRequest",
    "ImageBlock",
    "MessageParam",
    "MessagesRequest",
    "TextBlock",
    "ThinkingBlock",
    "ThinkingConfig",
    "Tool",
    "ToolChoice",
    "ToolResultBlock",
    "ToolUseBlock",
    "UrlSource",
    "parse_count_tokens_request",
    "UNSUPPORTED",
    "invalid_tool",
    "parse_messages_request",
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


_Source = Annotated[
    Annotated[Base64Source, kind("base64")] | Annotated[UrlSource, kind("url")],
    by_type(
        "an image source must be base64 or url (files are not supported)",
        ("base64", "url"),
        error="invalid_source",
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
    input: JsonObject


_ResultBlock = Annotated[
    Annotated[TextBlock, kind("text")] | Annotated[ImageBlock, kind("image")],
    by_type(
        "a tool_result's content blocks must be text or image",
        ("text", "image"),
        error="invalid_block",
    ),
]


class ToolResultBlock(Model):
    """What a call returned (in a user turn)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: (
        Annotated[
            Annotated[str, kind(STRING)] | Annotated[list[_ResultBlock], kind(ARRAY)],
            by_shape(
                "content must be a string or an array of blocks",
                STRING,
                ARRAY,
                error="invalid_content",
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


ContentBlock = Annotated[
    Annotated[TextBlock, kind("text")]
    | Annotated[ImageBlock, kind("image")]
    | Annotated[ToolUseBlock, kind("tool_use")]
    | Annotated[ToolResultBlock, kind("tool_result")]
    | Annotated[ThinkingBlock, kind("thinking")],
    by_type(
        "a content block must be text, image, tool_use, tool_result or thinking "
        "(documents and server tool blocks are not supported)",
        {
            "text": "text",
            "image": "image",
            "tool_use": "tool_use",
            "tool_result": "tool_result",
            "thinking": "thinking",
            "redacted_thinking": "thinking",
        },
        error="invalid_block",
    ),
]


class MessageParam(Model):
    """One turn: the user's or the assistant's."""

    role: Literal["user", "assistant"]
    content: Annotated[
        Annotated[str, kind(STRING)] | Annotated[list[ContentBlock], kind(ARRAY)],
        by_shape(
            "content must be a string or an array of content blocks",
            STRING,
            ARRAY,
            error="invalid_content",
        ),
    ]


class Tool(Model):
    """A client tool: its name, description and the JSON schema of its input
    (``cache_control``, ``strict`` and ``eager_input_streaming`` accepted: the server caches
    prefixes by itself; a call's input is checked as on every edge, and streamed once whole)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    input_schema: JsonObject
    cache_control: JsonObject | None = None
    strict: Bool | None = None
    eager_input_streaming: Bool | None = None
    defer_loading: Annotated[Bool | None, refused(DEFER_LOADING)] = None
    allowed_callers: Annotated[list[str] | None, refused(ALLOWED_CALLERS)] = None
    input_examples: Annotated[
        list[JsonObject] | None,
        refused(Unsupported("the model is not shown a tool's 'input_examples'", NOTHING)),
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _a_client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise invalid_tool(kind)
        return data


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


_System = Annotated[
    Annotated[str, kind(STRING)] | Annotated[list[TextBlock], kind(ARRAY)],
    by_shape(
        "system must be a string or an array of text blocks", STRING, ARRAY, error="invalid_system"
    ),
]


class ThinkingConfig(Model):
    """``thinking``: how the model reasons (its thinking blocks are always shown).

    - ``enabled`` with ``budget_tokens``: at most that many reasoning tokens; past them the
      engine makes the model end its reasoning (chat's ``thinking_token_budget``). Any
      budget of 1 or more is taken (Anthropic's own models want 1024), below ``max_tokens``.
    - ``disabled``: reasoning turned off through the chat template (``enable_thinking``:
      chat's ``reasoning_effort: "none"``); refused where the template cannot.
    - ``adaptive``: the model decides, as it always does here.
    """

    type: Annotated[
        Literal["enabled", "disabled", "adaptive"],
        refused(
            Unsupported(
                "thinking must be enabled (with budget_tokens), disabled or adaptive "
                "('between_tools' is not supported)",
                ("enabled", "disabled", "adaptive"),
            )
        ),
    ]
    budget_tokens: Count | None = None
    display: Annotated[
        Literal["summarized", "omitted"] | None,
        refused(
            Unsupported(
                "thinking is shown as the model wrote it ('omitted' is not supported)",
                (None, "summarized"),
            )
        ),
    ] = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise invalid("thinking.budget_tokens", "enabled thinking needs 'budget_tokens'")
        return self


class CountTokensRequest(Model):
    """The body of ``POST /v1/messages/count_tokens``: a Messages request without the
    generation settings."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: _System | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Accepted, and change nothing about the answer: the server caches prompt prefixes by
    # itself, and has no workspaces or user profiles.
    cache_control: JsonObject | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _fits_together(self) -> CountTokensRequest:
        names = [tool.name for tool in self.tools or ()]
        unique_names(names, "tools")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool"):
            if not names:
                raise invalid("tool_choice", f"tool_choice '{choice.type}' needs 'tools'")
            if choice.type == "tool" and choice.name not in set(names):
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
    stop_sequences: StopList | None = None
    temperature: Float | None = Field(default=None, ge=0, le=1)
    top_p: Float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, strict=True, ge=0, le=MAX_INT)
    stream: Bool = False
    metadata: JsonObject | None = None
    #: lower runs earlier (None: the API key's default priority, else 0); not Anthropic's
    #: own field: the clients send it in ``extra_body``
    priority: Priority | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        budget = None if thinking is None else thinking.budget_tokens
        if budget is not None and budget >= self.max_tokens:
            raise invalid(
                "thinking.budget_tokens",
                f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' "
                f"({self.max_tokens}): the answer needs room after the thinking",
            )
        return self

    @property
    def user(self) -> str | None:
        """``metadata.user_id``."""
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None


# ------------------------------------------------------------------ the unsupported fields


def invalid_tool(kind: object) -> PydanticCustomError:
    """A server tool (web search...), which this server does not run."""
    return PydanticCustomError(
        "server_tool",
        "a {kind} server tool: only client tools (name, description, input_schema) are supported",
        {"kind": repr(kind)},
    )


#: field -> the rule: what the API has and this server cannot do
UNSUPPORTED: Final[Mapping[str, Unsupported]] = {
    "container": Unsupported("containers are not supported", NOTHING),
    "mcp_servers": Unsupported("MCP servers are not supported", NOTHING),
    "context_management": Unsupported("context management is not supported", NOTHING),
    "service_tier": Unsupported(
        "only service_tier 'auto' is supported", (None, "auto", "standard_only")
    ),
    "output_config": Unsupported(
        "'output_config' (effort, format) is not supported: use thinking.budget_tokens",
        NOTHING,
    ),
    "speed": Unsupported("only speed 'standard' is supported", (None, "standard")),
    "diagnostics": Unsupported("prompt-cache diagnostics are not supported", NOTHING),
    "inference_geo": Unsupported(
        "'inference_geo' is not supported: inference runs where this server runs", NOTHING
    ),
}


def parse_messages_request(body: bytes | str | Mapping[str, Any]) -> MessagesRequest:
    """Validate a ``/v1/messages`` body.

    Raises:
        InvalidRequest: malformed JSON, an unsupported or invalid field (``param``).
    """
    return parse_body(MessagesRequest, body, unsupported=UNSUPPORTED)


def parse_count_tokens_request(body: bytes | str | Mapping[str, Any]) -> CountTokensRequest:
    """Validate a ``/v1/messages/count_tokens`` body.

    Raises:
        InvalidRequest: malformed JSON, an unsupported or invalid field (``param``).
    """
    return parse_body(CountTokensRequest, body, unsupported=UNSUPPORTED)
