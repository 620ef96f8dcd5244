"""A worker lost mid-answer, at every token position, is invisible on every edge.

The echo engine's fault injection (``fail_after_tokens=k``: the first attempt of every
request loses its worker after k tokens) makes Migration resume the answer on a retry; the
Backend's stop jail and the tool-call parser keep their state across it. Whatever k, what
the client reads through chat completions, the Responses API and the Messages API, streamed
or whole, must equal the fault-free answer, with a tool call and a stop string in it.
"""

from __future__ import annotations

from typing import Any

import pytest

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()
LAST_MESSAGE = "{{ messages[-1]['content'] }}"
SAID = (
    'Sure, let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "</tool_call> then STOP here"
)
ANSWER_TOKENS = len(TOKENIZER.encode(SAID))
RESPONSES_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ANTHROPIC_TOOL: Any = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


MIGRATED: list[float] = []  # retried migrations of the last app, per view


def app(fail_after: int | None) -> Any:
    engine = EchoEngine.from_tokenizer(TOKENIZER, fail_after_tokens=fail_after)
    return build_app(engine, TOKENIZER, model_name="echo", chat_template=LAST_MESSAGE)


def migrations(served: Any) -> float:
    labels = {"kind": "stream", "outcome": "retried"}
    return served.metrics.registry.get_sample_value("llm_pipeline_migrations_total", labels) or 0


async def responses_view(fail_after: int | None, stream: bool) -> Any:
    served = app(fail_after)
    async with openai_client(served) as api:
        request: dict[str, Any] = {
            "model": "echo",
            "input": SAID,
            "tools": [RESPONSES_TOOL],
            "extra_body": {"stop": ["STOP"]},
        }
        if stream:
            async with api.responses.stream(**request) as events:
                response = await events.get_final_response()
        else:
            response = await api.responses.create(**request)
    MIGRATED.append(migrations(served))
    return (
        [
            (item.type, getattr(item, "name", None), getattr(item, "arguments", None))
            for item in response.output
        ],
        response.output_text,
        response.status,
        response.usage.output_tokens,
    )  # type: ignore[union-attr]


async def messages_view(fail_after: int | None, stream: bool) -> Any:
    served = app(fail_after)
    async with anthropic_client(served) as api:
        request: dict[str, Any] = {
            "model": "echo",
            "max_tokens": 200,
            "messages": [{"role": "user", "content": SAID}],
            "tools": [ANTHROPIC_TOOL],
            "stop_sequences": ["STOP"],
        }
        if stream:
            async with api.messages.stream(**request) as events:
                message = await events.get_final_message()
        else:
            message = await api.messages.create(**request)
    MIGRATED.append(migrations(served))
    blocks = [
        (block.type, getattr(block, "text", None), getattr(block, "input", None))
        for block in message.content
    ]
    return blocks, message.stop_reason, message.usage.output_tokens


@pytest.mark.time_limit(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_lost_worker_at_every_position_is_invisible_on_the_responses_edge(
    stream: bool,
) -> None:
    reference = await responses_view(None, stream)
    items, text, status, generated = reference
    assert [kind for kind, _, _ in items] == ["message", "function_call", "message"]
    assert items[1][1:] == ("get_weather", '{"city": "Paris"}')
    assert text == "Sure, let me check.  then "
    assert status == "completed"
    assert generated < ANSWER_TOKENS  # (the stop string ends it)
    for k in range(1, generated):  # (k=0: nothing to resume; every attempt is a first)
        assert await responses_view(k, stream) == reference, f"worker lost after {k} tokens"
        assert MIGRATED[-1] == 1  # the worker was lost, and the answer moved


@pytest.mark.time_limit(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_lost_worker_at_every_position_is_invisible_on_the_messages_edge(
    stream: bool,
) -> None:
    reference = await messages_view(None, stream)
    blocks, stop_reason, generated = reference
    assert blocks == [
        ("text", "Sure, let me check. ", None),
        ("tool_use", None, {"city": "Paris"}),
        ("text", " then ", None),
    ]
    assert stop_reason == "tool_use"
    assert generated < ANSWER_TOKENS  # (the stop string ends it)
    for k in range(1, generated):  # (k=0: nothing to resume; every attempt is a first)
        assert await messages_view(k, stream) == reference, f"worker lost after {k} tokens"
        assert MIGRATED[-1] == 1  # the worker was lost, and the answer moved
