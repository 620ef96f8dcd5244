"""Tool calls and reasoning through the HTTP server, driven by the official ``openai`` client.

The echo engine with a template that renders only the last message makes the model "say"
exactly what a test writes, so every shape of output can be served: a call after text,
several calls, a malformed call, reasoning, and a worker lost in the middle of a call.
Streamed deltas, assembled the way a client assembles them, must equal the non-streamed
message.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from operators.engines import EchoEngine
from operators.parsers import MarkerToolFormat, register_tool_parser, tool_parser_names
from operators.serving import build_app
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()
LAST_MESSAGE = "{{ messages[-1]['content'] }}"
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time"}}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome ☀️"}}</tool_call>'


def app(**options: Any) -> Any:
    options.setdefault("chat_template", LAST_MESSAGE)
    engine = EchoEngine.from_tokenizer(TOKENIZER, fail_after_tokens=options.pop("fail", None))
    return build_app(engine, TOKENIZER, model_name="echo", **options)


async def ask(served: Any, said: str, **request: Any) -> Any:
    request.setdefault("tools", [WEATHER, TIME])
    async with openai_client(served) as client:
        return await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": said}], **request
        )


async def ask_streaming(served: Any, said: str, **request: Any) -> dict[str, Any]:
    """The streamed answer, assembled as a client does: content and reasoning joined, each
    call's pieces joined by index."""
    request.setdefault("tools", [WEATHER, TIME])
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    async with openai_client(served) as client:
        stream = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": said}], stream=True, **request
        )
        async for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                content.append(delta.content or "")
                reasoning.append(getattr(delta, "reasoning_content", None) or "")
                for piece in delta.tool_calls or ():
                    call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                    if piece.id is not None:
                        assert call["id"] is None, "a call's id comes once"
                        call["id"] = piece.id
                        assert piece.type == "function"
                    if piece.function is not None:
                        call["name"] += piece.function.name or ""
                        call["arguments"] += piece.function.arguments or ""
                if choice.finish_reason is not None:
                    assert finish is None, "one finish per choice"
                    finish = choice.finish_reason
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "calls": [calls[index] for index in sorted(calls)],
        "finish": finish,
    }


def message_of(reply: Any) -> dict[str, Any]:
    [choice] = reply.choices
    message = choice.message
    return {
        "content": message.content or "",
        "reasoning": getattr(message, "reasoning_content", None) or "",
        "calls": [
            {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
            for call in message.tool_calls or ()
        ],
        "finish": choice.finish_reason,
    }


def without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    calls = [{k: v for k, v in call.items() if k != "id"} for call in answer["calls"]]
    return {**answer, "calls": calls}


async def test_a_call_after_text_becomes_a_tool_call() -> None:
    served = app()
    said = f"Let me look that up. {PARIS}"
    answer = message_of(await ask(served, said))
    assert answer["content"] == "Let me look that up. "
    [call] = answer["calls"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["id"].startswith("call_")
    assert answer["finish"] == "tool_calls"
    assert without_ids(await ask_streaming(served, said)) == without_ids(answer)


async def test_several_calls_keep_their_order_and_text_between_them() -> None:
    served = app()
    said = f"{PARIS} and {ROME}"
    answer = message_of(await ask(served, said))
    assert [json.loads(call["arguments"]) for call in answer["calls"]] == [
        {"city": "Paris"},
        {"city": "Rome ☀️"},
    ]
    assert "<tool_call>" not in answer["content"]
    assert len({call["id"] for call in answer["calls"]}) == 2
    assert without_ids(await ask_streaming(served, said)) == without_ids(answer)


async def test_no_tools_means_no_parsing() -> None:
    answer = message_of(await ask(app(), PARIS, tools=openai.NOT_GIVEN))
    assert answer == {"content": PARIS, "reasoning": "", "calls": [], "finish": "stop"}
    answer = message_of(await ask(app(), PARIS, tool_choice="none"))
    assert answer["content"] == PARIS
    assert answer["calls"] == []


async def test_a_malformed_call_stays_content() -> None:
    said = 'Hmm <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> ok'
    answer = message_of(await ask(app(), said))
    assert answer == {"content": said, "reasoning": "", "calls": [], "finish": "stop"}
    unknown = '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'
    assert message_of(await ask(app(), unknown))["content"] == unknown


async def test_a_call_survives_a_lost_worker_at_every_position() -> None:
    said = f"Checking. {PARIS}"
    expected = without_ids(message_of(await ask(app(), said)))
    tokens = len(TOKENIZER.encode(said))
    for fail in range(1, tokens):
        served = app(fail=fail)
        assert without_ids(message_of(await ask(served, said))) == expected, fail
        assert without_ids(await ask_streaming(app(fail=fail), said)) == expected, fail


async def test_reasoning_moves_to_reasoning_content() -> None:
    served = app(reasoning_parser="think")
    said = f"<think>The user wants Paris.</think>Sure. {PARIS}"
    answer = message_of(await ask(served, said))
    assert answer["reasoning"] == "The user wants Paris."
    assert answer["content"] == "Sure. "
    assert [call["name"] for call in answer["calls"]] == ["get_weather"]
    assert without_ids(await ask_streaming(served, said)) == without_ids(answer)
    # without tools, reasoning is still parsed
    plain = message_of(await ask(served, "<think>a</think>b", tools=openai.NOT_GIVEN))
    assert (plain["reasoning"], plain["content"]) == ("a", "b")


async def test_logprobs_and_usage_cover_every_token_of_a_call() -> None:
    said = f"A {PARIS}"
    reply = await ask(app(), said, logprobs=True)
    [choice] = reply.choices
    assert choice.logprobs is not None
    tokens = len(TOKENIZER.encode(said))
    assert reply.usage.completion_tokens == tokens
    assert len(choice.logprobs.content) == tokens
    assert "".join(entry.token for entry in choice.logprobs.content) == said


SCHEMA: Any = {"name": "a", "schema": {}}


async def refused(served: Any, **request: Any) -> Any:
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(served, "hi", **request)
    return caught.value.body


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {}},
                }
            },
            "response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ],
)
async def test_an_engine_without_constrained_decoding_refuses_by_field(
    request_: dict[str, Any], param: str
) -> None:
    body = await refused(app(), **request_)
    assert body["param"] == param
    assert "EchoEngine" in body["message"]


async def test_tools_without_a_parser_are_refused() -> None:
    body = await refused(app(tool_call_parser=None))
    assert body["param"] == "tools"


async def test_the_pythonic_format_cannot_be_required() -> None:
    body = await refused(app(tool_call_parser="pythonic"), tool_choice="required")
    assert body["param"] == "tool_choice"


async def test_a_format_registered_from_python_parses_through_the_server() -> None:
    if "functioncall" not in tool_parser_names():
        register_tool_parser("functioncall", MarkerToolFormat(start="<functioncall>", end="</f>"))
    served = app(tool_call_parser="functioncall")
    said = 'On it. <functioncall>{"name": "get_time", "arguments": {}}</f>'
    answer = message_of(await ask(served, said))
    assert answer["content"] == "On it. "
    assert [(call["name"], call["arguments"]) for call in answer["calls"]] == [("get_time", "{}")]
    assert without_ids(await ask_streaming(served, said)) == without_ids(answer)
    # the other formats' markers are plain text to it
    assert message_of(await ask(served, PARIS))["content"] == PARIS
