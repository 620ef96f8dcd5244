"""Tools and structured output on the real model: ``llm-pipeline serve --engine llama
--tool-call-parser hermes`` driven by the official ``openai`` client.

SmolLM2-135M's own template has no tool section, so these requests render through the
shipped Hermes-style template; ``tool_choice: "required"`` and ``response_format`` are
honoured by constrained decoding, so even this small model's answers are valid calls and
valid JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.server_process import ServerProcess, run_cli

# a real model on one thread: twenty answers take longer than the suite's usual limit
pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.time_limit(120)]

llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 40}},
                "required": ["zone"],
            },
        },
    },
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def llama() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "--engine", "llama", "--threads", "1", "--tool-call-parser", "hermes", startup_timeout=60
    )
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def schema_of(name: str) -> dict[str, Any]:
    [tool] = [tool for tool in TOOLS if tool["function"]["name"] == name]
    parameters: dict[str, Any] = tool["function"]["parameters"]
    return parameters


async def test_required_returns_a_call_valid_against_its_schema(llama: ServerProcess) -> None:
    async with client(llama) as api:
        reply = await api.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,  # type: ignore[arg-type]
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=120,
        )
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schema_of(call.function.name))
    assert not choice.message.content  # nothing but calls
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 0


async def test_streamed_call_deltas_assemble_to_the_same_call(llama: ServerProcess) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK_WEATHER,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 120,
    }
    async with client(llama) as api:
        whole = await api.chat.completions.create(**request)
        stream = await api.chat.completions.create(**request, stream=True)
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        finishes = []
        async for chunk in stream:
            for choice in chunk.choices:
                for piece in choice.delta.tool_calls or ():
                    function = piece.function
                    if function is not None:
                        names[piece.index] = names.get(piece.index, "") + (function.name or "")
                        arguments[piece.index] = arguments.get(piece.index, "") + (
                            function.arguments or ""
                        )
                if choice.finish_reason is not None:
                    finishes.append(choice.finish_reason)
    [call] = whole.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # the named function, and only it
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert names == {0: "get_weather"}
    assert arguments == {0: call.function.arguments}
    assert finishes == ["tool_calls"]


async def test_a_tool_result_fed_back_renders_and_is_answered(llama: ServerProcess) -> None:
    async with client(llama) as api:
        first = await api.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,  # type: ignore[arg-type]
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=120,
        )
        [call] = first.choices[0].message.tool_calls or []
        second = await api.chat.completions.create(
            model=MODEL,
            messages=[
                *ASK_WEATHER,  # type: ignore[list-item]
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {
                                "name": call.function.name,
                                "arguments": call.function.arguments,
                            },
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": '{"temperature": 18, "sky": "sunny"}',
                },
            ],
            tools=TOOLS,
            temperature=0,
            max_tokens=40,
        )
    [choice] = second.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls  # it answered
    assert second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


class City(BaseModel):
    """What ``parse`` must return for each prompt."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    is_capital: bool


PLACES = [
    "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Warsaw", "Prague", "Oslo",
    "Dublin", "Athens", "Cairo", "Tokyo", "Lima", "Ottawa", "Sydney", "Toronto", "Milan",
    "Munich", "Osaka",
]  # fmt: skip


async def test_parse_returns_a_parsed_object_on_twenty_prompts(llama: ServerProcess) -> None:
    parsed: dict[str, City] = {}

    async def ask(api: openai.AsyncOpenAI, place: str) -> None:
        reply = await api.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe the city of {place} as JSON."}],
            response_format=City,
            temperature=0,
            max_tokens=100,
        )
        [choice] = reply.choices
        assert choice.finish_reason == "stop", (place, choice.message.content)
        assert choice.message.parsed is not None, (place, choice.message.content)
        parsed[place] = choice.message.parsed

    async with client(llama) as api, anyio.create_task_group() as tg:
        for place in PLACES:
            tg.start_soon(ask, api, place)
    assert sorted(parsed) == sorted(PLACES)
    assert all(isinstance(city, City) for city in parsed.values())


async def test_json_object_is_a_json_object(llama: ServerProcess) -> None:
    async with client(llama) as api:
        reply = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give me a small JSON object about cats."}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=100,
        )
    [choice] = reply.choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


async def test_an_unusable_schema_is_a_400_naming_response_format(llama: ServerProcess) -> None:
    async with client(llama) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model=MODEL,
                messages=ASK_WEATHER,  # type: ignore[arg-type]
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                },
                max_tokens=10,
            )
    body: Any = caught.value.body
    assert body["param"] == "response_format"


# --------------------------------------------------------------- the CLI's own errors


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--tool-call-parser", "nope"], "--tool-call-parser"),
        (["--reasoning-parser", "nope"], "--reasoning-parser"),
        (["--tool-call-parser", "no_such_module:FORMAT"], "cannot import"),
        (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
    ],
)
def test_bad_parsers_and_templates_exit_2(args: list[str], words: str) -> None:
    result = run_cli(["serve", "--port", "0", *args])
    assert result.returncode == 2
    assert words in result.stderr
    assert "Traceback" not in result.stderr
