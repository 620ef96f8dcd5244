"""No field an official SDK can send is ever silently dropped: every one is modelled (and so
honoured, or accepted as changing nothing, as its model's docstring says) or refused by name.

The table is derived, not kept: each edge's fields are its pydantic model's (aliases as sent)
plus its table of refused fields, and each API's are its official SDK's request types
(``openai.types.chat.completion_create_params`` and the rest: every key the SDK's TypedDicts
can carry). A new SDK field fails here until it is decided. Nested settings objects are
checked the same way (``reasoning``, ``text``, ``thinking``, ``stream_options``, tools, tool
choices). Fields of other servers' APIs stay ignored, as the design says: the check is
one-way.

The refusals are then driven: each refused top-level field, sent with a value that asks for
something, is a 400 naming it; and each nested field the models refuse by annotation is too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from anthropic.types import (
    message_count_tokens_params,
    message_create_params,
    thinking_config_adaptive_param,
    thinking_config_disabled_param,
    thinking_config_enabled_param,
    tool_choice_any_param,
    tool_choice_auto_param,
    tool_choice_none_param,
    tool_choice_tool_param,
    tool_param,
)
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import (
    chat_completion_stream_options_param,
)
from openai.types.chat import (
    completion_create_params as chat_create_params,
)
from openai.types.responses import (
    function_tool_param,
    response_create_params,
    response_format_text_json_schema_config_param,
    response_text_config_param,
)
from openai.types.shared_params import reasoning as reasoning_param
from pydantic import BaseModel

from operators.edges.anthropic import protocol as messages
from operators.edges.http.schema import Unsupported
from operators.edges.openai.embeddings import UNSUPPORTED as EMBEDDINGS_UNSUPPORTED
from operators.edges.openai.embeddings import EmbeddingRequest, parse_embedding_request
from operators.edges.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    parse_chat_request,
    parse_completion_request,
)
from operators.edges.openai.unsupported import (
    CHAT_UNSUPPORTED,
    COMPLETIONS_UNSUPPORTED,
    VERBOSITY,
)
from operators.edges.responses import protocol as responses
from pipeline import InvalidRequest

NOTHING_REFUSED: Mapping[str, Unsupported] = {}


def sdk_fields(*types: Any) -> set[str]:
    """Every key the SDK's TypedDicts can carry."""
    return {key for typed in types for key in typed.__required_keys__ | typed.__optional_keys__}


def model_fields(model: type[BaseModel]) -> set[str]:
    """Every field ``model`` reads, as the client sends it (its alias, else its name)."""
    return {field.alias or name for name, field in model.model_fields.items()}


#: (edge, the SDK's request types, our model, the fields refused before the model)
EDGES: list[tuple[str, tuple[Any, ...], type[BaseModel], Mapping[str, Unsupported]]] = [
    (
        "chat",
        (
            chat_create_params.CompletionCreateParamsNonStreaming,
            chat_create_params.CompletionCreateParamsStreaming,
        ),
        ChatCompletionRequest,
        CHAT_UNSUPPORTED,
    ),
    (
        "completions",
        (
            completion_create_params.CompletionCreateParamsNonStreaming,
            completion_create_params.CompletionCreateParamsStreaming,
        ),
        CompletionRequest,
        COMPLETIONS_UNSUPPORTED,
    ),
    (
        "responses",
        (
            response_create_params.ResponseCreateParamsNonStreaming,
            response_create_params.ResponseCreateParamsStreaming,
        ),
        responses.ResponsesRequest,
        responses.UNSUPPORTED,
    ),
    (
        "messages",
        (
            message_create_params.MessageCreateParamsNonStreaming,
            message_create_params.MessageCreateParamsStreaming,
        ),
        messages.MessagesRequest,
        messages.UNSUPPORTED,
    ),
    (
        "count_tokens",
        (message_count_tokens_params.MessageCountTokensParams,),
        messages.CountTokensRequest,
        messages.UNSUPPORTED,
    ),
    (
        "embeddings",
        (embedding_create_params.EmbeddingCreateParams,),
        EmbeddingRequest,
        EMBEDDINGS_UNSUPPORTED,
    ),
    # the settings objects inside them
    (
        "chat stream_options",
        (chat_completion_stream_options_param.ChatCompletionStreamOptionsParam,),
        StreamOptions,
        NOTHING_REFUSED,
    ),
    ("responses reasoning", (reasoning_param.Reasoning,), responses.ReasoningConfig, {}),
    (
        "responses text",
        (response_text_config_param.ResponseTextConfigParam,),
        responses.TextConfig,
        NOTHING_REFUSED,
    ),
    (
        "responses text.format",
        (response_format_text_json_schema_config_param.ResponseFormatTextJSONSchemaConfigParam,),
        responses.TextFormatSpec,
        NOTHING_REFUSED,
    ),
    (
        "responses stream_options",
        (response_create_params.StreamOptions,),
        responses.ResponsesStreamOptions,
        NOTHING_REFUSED,
    ),
    (
        "responses tools",
        (function_tool_param.FunctionToolParam,),
        responses.FunctionTool,
        NOTHING_REFUSED,
    ),
    (
        "messages thinking",
        (
            thinking_config_enabled_param.ThinkingConfigEnabledParam,
            thinking_config_disabled_param.ThinkingConfigDisabledParam,
            thinking_config_adaptive_param.ThinkingConfigAdaptiveParam,
        ),
        messages.ThinkingConfig,
        NOTHING_REFUSED,
    ),
    ("messages tools", (tool_param.ToolParam,), messages.Tool, NOTHING_REFUSED),
    (
        "messages tool_choice",
        (
            tool_choice_auto_param.ToolChoiceAutoParam,
            tool_choice_any_param.ToolChoiceAnyParam,
            tool_choice_tool_param.ToolChoiceToolParam,
            tool_choice_none_param.ToolChoiceNoneParam,
        ),
        messages.ToolChoice,
        NOTHING_REFUSED,
    ),
]


@pytest.mark.parametrize(
    ("sdk_types", "model", "refused"),
    [pytest.param(types, model, refused, id=edge) for edge, types, model, refused in EDGES],
)
def test_every_field_the_sdk_can_send_is_modelled_or_refused(
    sdk_types: tuple[Any, ...], model: type[BaseModel], refused: Mapping[str, Unsupported]
) -> None:
    sent = sdk_fields(*sdk_types)
    known = model_fields(model) | set(refused)
    assert sent - known == set(), "fields the SDK sends that would be dropped silently"
    # (the table is not vacuous: most of what the SDK sends is modelled)
    assert len(sent & model_fields(model)) >= len(sent) // 2


#: a body each edge takes, and how it parses one
PARSERS: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
    "chat": (parse_chat_request, {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": (parse_completion_request, {"prompt": "hi"}),
    "responses": (responses.parse_responses_request, {"input": "hi"}),
    "messages": (
        messages.parse_messages_request,
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "count_tokens": (
        messages.parse_count_tokens_request,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ),
    "embeddings": (parse_embedding_request, {"input": "hi"}),
}
#: a value no table finds harmless
ASKING: Any = {"asks": "something"}


@pytest.mark.parametrize(
    ("edge", "field"),
    [
        (edge, field)
        for edge, _, _, refused in EDGES
        if edge in PARSERS
        for field in sorted(refused)
    ],
)
def test_every_refused_field_is_refused_by_name(edge: str, field: str) -> None:
    parse, body = PARSERS[edge]
    with pytest.raises(InvalidRequest) as refused:
        parse({**body, field: ASKING})
    assert refused.value.param == field
    # ... and what asks for nothing is accepted: absent or null
    parse({**body, field: None})


@pytest.mark.parametrize(
    ("edge", "fields", "param"),
    [
        ("responses", {"text": {"verbosity": "high"}}, "text.verbosity"),
        ("responses", {"reasoning": {"mode": "pro"}}, "reasoning.mode"),
        ("responses", {"reasoning": {"context": "all_turns"}}, "reasoning.context"),
        (
            "responses",
            {"tools": [{"type": "function", "name": "f", "defer_loading": True}]},
            "tools.0.defer_loading",
        ),
        (
            "responses",
            {"tools": [{"type": "function", "name": "f", "async": True}]},
            "tools.0.async",
        ),
        (
            "responses",
            {"tools": [{"type": "function", "name": "f", "allowed_callers": ["programmatic"]}]},
            "tools.0.allowed_callers",
        ),
        (
            "responses",
            {"tools": [{"type": "function", "name": "f", "output_schema": {"type": "string"}}]},
            "tools.0.output_schema",
        ),
        ("messages", {"thinking": {"type": "between_tools"}}, "thinking.type"),
        ("messages", {"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking.display"),
        (
            "messages",
            {"tools": [{"name": "f", "input_schema": {}, "input_examples": [{"a": 1}]}]},
            "tools.0.input_examples",
        ),
        (
            "messages",
            {"tools": [{"name": "f", "input_schema": {}, "defer_loading": True}]},
            "tools.0.defer_loading",
        ),
    ],
)
def test_nested_fields_that_cannot_be_honoured_are_refused_by_name(
    edge: str, fields: dict[str, Any], param: str
) -> None:
    parse, body = PARSERS[edge]
    with pytest.raises(InvalidRequest) as refused:
        parse({**body, **fields})
    assert refused.value.param == param


@pytest.mark.parametrize("value", ["medium", None, "low", "high"])
def test_one_verbosity_rule_for_chat_and_responses(value: str | None) -> None:
    """Chat's ``verbosity`` and Responses' ``text.verbosity`` take the same values, and are
    refused with the same words."""
    said: list[str | None] = []
    for parse, body in (
        (parse_chat_request, {"messages": [{"role": "user", "content": "hi"}], "verbosity": value}),
        (responses.parse_responses_request, {"input": "hi", "text": {"verbosity": value}}),
    ):
        try:
            parse(body)
        except InvalidRequest as exc:
            said.append(exc.message)
        else:
            said.append(None)
    if value in ("medium", None):
        assert said == [None, None]
    else:
        assert all(message is not None and VERBOSITY.message in message for message in said)


def test_fields_of_other_servers_stay_ignored() -> None:
    """The check above is one-way: an extension this server does not know (another server's
    ``extra_body`` field) is not refused."""
    request = parse_chat_request(
        {"messages": [{"role": "user", "content": "hi"}], "guided_decoding_backend": "x"}
    )
    assert "guided_decoding_backend" not in request.model_dump()
