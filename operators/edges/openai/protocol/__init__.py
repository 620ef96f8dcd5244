"""The OpenAI request models: the HTTP edge where untrusted JSON becomes typed requests.

It validates (through :func:`operators.edges.http.schema.parse_body`, as every edge) the bodies of
``/v1/chat/completions`` (:class:`ChatCompletionRequest`) and ``/v1/completions``
(:class:`CompletionRequest`) and converts the generation fields into the hot-path records of
:mod:`operators.contracts.llm` (:meth:`GenerationRequest.stop_conditions`, ``sampling_options()``,
``output_options()``). Responses are *not* modelled here: the preprocessor builds stream
chunks as plain dicts, because a pydantic object per token is the cost this project avoids.

:func:`parse_chat_request` and :func:`parse_completion_request` are where
JSON and pydantic errors become :class:`pipeline.InvalidRequest`, with ``param`` naming the
offending field as a dotted path (``"messages.0.content"``). OpenAI fields the server cannot
honour (``logit_bias``, ``audio``...) are refused with a 400 naming them
(:mod:`operators.edges.openai.unsupported`); fields we do not know (``extra_body`` extensions of
other servers) are ignored; ``null`` means "use the default" for every top-level field.

The package: :mod:`.messages` (chat messages),
:mod:`.requests` (the two request bodies), :mod:`.tools` (tools, ``tool_choice`` and
``response_format``), :mod:`.parsing` (the boundary).
"""

from .messages import ChatMessage, ContentPart, ImageURL
from .parsing import parse_chat_request, parse_completion_request
from .requests import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ReasoningEffort,
    StreamOptions,
)
from .tools import (
    FunctionDefinition,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextFormat,
    ToolChoice,
    ToolDefinition,
)

__all__ = (
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "FunctionDefinition",
    "GenerationRequest",
    "ImageURL",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "NamedFunction",
    "NamedToolChoice",
    "ReasoningEffort",
    "ResponseFormat",
    "StreamOptions",
    "TextFormat",
    "ToolChoice",
    "ToolDefinition",
    "parse_chat_request",
    "parse_completion_request",
)
