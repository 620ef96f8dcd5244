"""``serve --engine echo --echo last-message``: echo answers with the last message's text.

With the default (``--echo prompt``) echo streams back the whole conversation as the chat
template renders it, system prompt and tools preamble included, so an agent loop on it
never ends; an application's test suite wants the last message back instead. Driven as a
user would: a ``serve`` subprocess and the official ``openai`` and ``anthropic`` clients,
on chat completions, Responses and Messages.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

SYSTEM = "You are a weather bot. Never say anything else."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
#: the same tool in the Responses API's shape
WEATHER_TOOL: Any = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
USER = {"role": "user", "content": "Is it sunny, then?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.fixture(scope="module")
def last_message() -> Iterator[ServerProcess]:
    server = ServerProcess("--echo", "last-message")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def whole_prompt() -> Iterator[ServerProcess]:
    server = ServerProcess("--echo", "prompt")
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=10)


def conversation(last: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        last,
    ]


async def test_the_default_echoes_the_rendered_conversation(whole_prompt: ServerProcess) -> None:
    result = {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}
    async with client(whole_prompt) as api:
        reply = await api.chat.completions.create(
            model="echo", messages=[{"role": "system", "content": SYSTEM}, USER]
        )
        looping = await api.chat.completions.create(
            model="echo",
            messages=conversation(result),
            tools=[WEATHER],  # type: ignore[list-item]
        )
    text = reply.choices[0].message.content or ""
    assert text.startswith(f"system\n{SYSTEM}")  # (role markers are special: not echoed)
    assert text.rstrip().endswith("user\nIs it sunny, then?\nassistant")
    # The earlier turn's call is echoed too, and parsed as a new one: the loop goes on.
    assert looping.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        (USER, "Is it sunny, then?"),
        ({"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}, "22 C, sunny"),
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            },
            "one\ntwo",
        ),
    ],
    ids=["a user turn", "a tool result", "text parts"],
)
async def test_a_chat_is_answered_with_its_last_message(
    last_message: ServerProcess, last: dict[str, Any], expected: str
) -> None:
    async with client(last_message) as api:
        reply = await api.chat.completions.create(
            model="echo",
            messages=conversation(last),
            tools=[WEATHER],  # type: ignore[list-item]
        )
        streamed = await api.chat.completions.create(
            model="echo",
            messages=conversation(last),
            tools=[WEATHER],
            stream=True,  # type: ignore[list-item]
        )
        chunks = [chunk async for chunk in streamed]
    choice = reply.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (expected, None)
    assert choice.finish_reason == "stop"  # an agent loop ends here
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


async def test_max_tokens_still_cuts_the_echo(last_message: ServerProcess) -> None:
    async with client(last_message) as api:
        reply = await api.chat.completions.create(model="echo", messages=[USER], max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    assert "Is it sunny, then?".startswith(reply.choices[0].message.content or "-")


async def test_an_empty_last_message_is_a_400_naming_messages(last_message: ServerProcess) -> None:
    async with client(last_message) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            await api.chat.completions.create(
                model="echo", messages=[USER, {"role": "user", "content": ""}]
            )
    assert refused.value.status_code == 400
    assert "messages" in str(refused.value.body)


async def test_a_responses_request_is_answered_with_its_last_input(
    last_message: ServerProcess,
) -> None:
    async with client(last_message) as api:
        first = await api.responses.create(
            model="echo", instructions=SYSTEM, input="Weather in Paris?", tools=[WEATHER_TOOL]
        )
        assert first.output_text == "Weather in Paris?"
        follow_up = await api.responses.create(
            model="echo", previous_response_id=first.id, input="And in Rome?"
        )
    assert follow_up.output_text == "And in Rome?"
    assert follow_up.status == "completed"


async def test_a_messages_request_is_answered_with_its_last_message(
    last_message: ServerProcess,
) -> None:
    api = anthropic.AsyncAnthropic(base_url=last_message.url, api_key="x", max_retries=0)
    async with api:
        message = await api.messages.create(
            model="echo",
            max_tokens=100,
            system=SYSTEM,
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me look."},
                {"role": "user", "content": "Quickly, please."},
            ],
        )
    assert [block.text for block in message.content if block.type == "text"] == ["Quickly, please."]
    assert message.stop_reason == "end_turn"
