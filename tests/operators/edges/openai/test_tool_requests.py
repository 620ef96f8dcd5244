"""The request side of tools and structured output: validation (each error names its field),
the chat template (tools reach it; the shipped Hermes-style template when the model's own
ignores tools; an explicit template is respected), and what the preprocessor hands on
(``PreprocessedRequest.tools`` and ``.constraint``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from operators.contracts.llm import Constraint, Tool
from operators.edges.openai import OpenAIPreprocessor
from operators.edges.openai.chat_template import ChatTemplate, tool_chat_template
from operators.edges.openai.protocol import parse_chat_request, parse_completion_request
from operators.text.tokenizer import Tokenizer
from pipeline import InvalidRequest

TOKENIZER = Tokenizer.default()
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}


class Hermes:
    """A stand-in tool-call format: records what it was asked to constrain."""

    def __init__(self) -> None:
        self.asked: list[tuple[tuple[Tool, ...], bool, str]] = []

    def constraint(self, tools: Any, *, parallel: bool, param: str) -> Constraint | None:
        self.asked.append((tuple(tools), parallel, param))
        return Constraint(param=param, prefix="<tool_call>", suffix="</tool_call>")


class Unconstrainable:
    def constraint(self, tools: Any, *, parallel: bool, param: str) -> Constraint | None:
        return None


def preprocess(body: dict[str, Any], tool_format: Any = None, **options: Any) -> Any:
    preprocessor = OpenAIPreprocessor(TOKENIZER, model_name="m", tool_format=tool_format, **options)
    [request] = preprocessor.preprocess(parse_chat_request({"messages": USER, **body}))
    return request


def refusal(parse: Any, body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    return caught.value


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "'f', which is not one of 'tools' (get_weather)",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools.1", "two tools are named 'get_weather'"),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools.0.function.name",
            "pattern",
        ),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "function"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'required'"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "Missing"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "Missing",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 1}}},
            "response_format.json_schema.schema",
            "dictionary",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "cannot both constrain",
        ),
    ],
)
def test_each_invalid_field_is_named(body: dict[str, Any], param: str, words: str) -> None:
    error = refusal(parse_chat_request, {"messages": USER, **body})
    assert error.param == param
    assert words in str(error)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [WEATHER]),
        ("tool_choice", "required"),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_completions_still_refuse_what_only_chat_honours(field: str, value: Any) -> None:
    error = refusal(parse_completion_request, {"prompt": "hi", field: value})
    assert error.param == field


def test_null_and_text_ask_for_nothing() -> None:
    request = parse_chat_request(
        {
            "messages": USER,
            "tools": None,
            "tool_choice": None,
            "response_format": {"type": "text"},
        }
    )
    assert request.effective_tool_choice == "none"
    assert preprocess({"response_format": {"type": "text"}}).constraint is None


# ---------------------------------------------------------------------- the template


def test_smollm2s_template_ignores_tools_and_the_shipped_one_shows_them() -> None:
    assert TOKENIZER.chat_template is not None
    assert not ChatTemplate(TOKENIZER.chat_template).handles_tools
    assert ChatTemplate(tool_chat_template()).handles_tools


def render(body: dict[str, Any], **options: Any) -> str:
    preprocessor = OpenAIPreprocessor(TOKENIZER, model_name="m", tool_format=Hermes(), **options)
    return preprocessor.render_chat(parse_chat_request({"messages": USER, **body}))


def test_offered_tools_reach_the_template() -> None:
    text = render({"tools": [WEATHER, TIME]})
    assert "<tools>" in text
    assert json.dumps(WEATHER) in text
    assert '"get_time"' in text
    assert text.endswith("<|im_start|>assistant\n")
    # without tools the model's own template renders (SmolLM2's default system prompt)
    assert "SmolLM" in render({})
    assert "<tools>" not in render({})


def test_tool_choice_none_shows_no_tools() -> None:
    assert "<tools>" not in render({"tools": [WEATHER], "tool_choice": "none"})


def test_a_second_turn_renders_the_call_and_its_result() -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    text = render({"messages": messages, "tools": [WEATHER]})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    # history with calls renders through the tool template even with no tools offered now
    assert "<tool_response>" in render({"messages": messages})


def test_an_explicit_template_is_respected() -> None:
    template = "{% for m in messages %}{{ m['content'] }}|{{ tools | length }}{% endfor %}"
    assert render({"tools": [WEATHER]}, chat_template=template) == (
        "What is the weather in Paris?|1"
    )


# ----------------------------------------------------------- what the engine is told


def test_auto_parses_calls_and_constrains_nothing() -> None:
    request = preprocess({"tools": [WEATHER, TIME]}, Hermes())
    assert [tool.name for tool in request.tools] == ["get_weather", "get_time"]
    assert request.tools[0].parameters == WEATHER["function"]["parameters"]
    assert request.constraint is None


def test_none_parses_nothing() -> None:
    request = preprocess({"tools": [WEATHER], "tool_choice": "none"}, Hermes())
    assert request.tools == ()
    assert request.constraint is None


def test_required_asks_the_format_for_a_constraint_over_every_tool() -> None:
    hermes = Hermes()
    request = preprocess({"tools": [WEATHER, TIME], "tool_choice": "required"}, hermes)
    [(tools, parallel, param)] = hermes.asked
    assert [tool.name for tool in tools] == ["get_weather", "get_time"]
    assert parallel
    assert param == "tool_choice"
    assert request.constraint == Constraint(
        param="tool_choice", prefix="<tool_call>", suffix="</tool_call>"
    )
    preprocess(
        {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
        hermes,
    )
    assert hermes.asked[-1][1] is False


def test_a_named_function_constrains_to_that_one_call() -> None:
    hermes = Hermes()
    preprocess(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        hermes,
    )
    [(tools, parallel, _)] = hermes.asked
    assert [tool.name for tool in tools] == ["get_time"]
    assert not parallel


def test_response_formats_become_constraints() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = preprocess(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    )
    assert request.constraint == Constraint(param="response_format", json_schema=schema)
    request = preprocess({"response_format": {"type": "json_object"}})
    assert request.constraint == Constraint(param="response_format")


def test_tools_without_a_format_are_refused() -> None:
    error = refusal(lambda body: preprocess(body), {"tools": [WEATHER]})
    assert error.param == "tools"
    assert "--tool-call-parser" in str(error)


def test_a_format_that_cannot_constrain_refuses_required() -> None:
    error = refusal(
        lambda body: preprocess(body, Unconstrainable()),
        {"tools": [WEATHER], "tool_choice": "required"},
    )
    assert error.param == "tool_choice"
    # auto needs no constraint
    assert preprocess({"tools": [WEATHER]}, Unconstrainable()).constraint is None
