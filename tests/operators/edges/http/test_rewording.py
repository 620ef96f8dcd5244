"""The graph blames chat's field names; each API's errors name the field as its client sent
it, in ``param`` and in the message: every message the graph and the engines write that
names a field, translated by the Responses and Anthropic styles."""

from __future__ import annotations

import pytest

from operators.edges.anthropic.errors import translate as anthropic
from operators.edges.http.failures import ApiError
from operators.edges.responses.edge import translate as responses


@pytest.mark.parametrize(
    ("message", "param", "responses_says", "anthropic_says"),
    [
        (
            "'response_format' needs constrained decoding, which EchoEngine does not support",
            "response_format",
            "'text.format' needs constrained decoding, which EchoEngine does not support",
            None,
        ),
        (
            "prompt (9 tokens) + max_tokens (5) = 14 exceeds the context window of 10 tokens: "
            "lower max_tokens or shorten the prompt",
            "max_tokens",
            "prompt (9 tokens) + max_output_tokens (5) = 14 exceeds the context window of 10 "
            "tokens: lower max_output_tokens or shorten the input",
            "prompt (9 tokens) + max_tokens (5) = 14 exceeds the context window of 10 tokens: "
            "lower max_tokens or shorten the messages",
        ),
        (
            "This model's maximum context length is 10 tokens, but the messages has 12 tokens, "
            "which leaves no room for a completion. Shorten the messages.",
            "messages",
            "This model's maximum context length is 10 tokens, but the input has 12 tokens, "
            "which leaves no room for a completion. Shorten the input.",
            None,
        ),
        (
            "'reasoning_effort' needs an engine that can end the model's reasoning",
            "reasoning_effort",
            "'reasoning.effort' needs an engine that can end the model's reasoning",
            "'thinking.type' needs an engine that can end the model's reasoning",
        ),
        (
            "'thinking_token_budget' cannot be combined with 'tool_choice'",
            "thinking_token_budget",
            None,
            "'thinking.budget_tokens' cannot be combined with 'tool_choice'",
        ),
        (
            "tool_choice 'required' is not supported with this server's tool-call format",
            "tool_choice",
            None,
            "tool_choice 'any' is not supported with this server's tool-call format",
        ),
        ("at most 64 stop strings are allowed", "stop", None, None),  # English stays
    ],
)
def test_messages_name_the_field_as_the_client_sent_it(
    message: str, param: str, responses_says: str | None, anthropic_says: str | None
) -> None:
    error = ApiError("invalid_request", message, param)
    assert responses(error).message == (responses_says or message)
    assert anthropic(error).message == (anthropic_says or message)
