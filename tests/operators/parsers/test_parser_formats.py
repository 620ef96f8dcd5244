"""The sans-IO parsers: any split of a model's output parses as the whole output does.

Property tests draw outputs with known parses (``parser_cases``) and cut them at random
character positions, markers and multi-byte characters included; the reassembled stream
must equal the one-shot parse and the constructed expectation. Examples pin each
format's rules, the fallbacks and the constraints.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.contracts.llm import Constraint, Tool
from operators.parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    THINK,
    ChoiceParser,
    MarkerReasoningFormat,
    MarkerToolFormat,
    ReasoningFormat,
    ToolCallFormat,
    checked_calls,
)
from tests.operators.parsers.parser_cases import (
    MARKER,
    TOOLS,
    Case,
    decided,
    hermes_cases,
    llama3_json_cases,
    mistral_cases,
    parse,
    pythonic_cases,
    splits,
)

FORMATS = {"hermes": HERMES, "mistral": MISTRAL, "llama3_json": LLAMA3_JSON, "pythonic": PYTHONIC}
CASES = {
    "hermes": hermes_cases(),
    "mistral": mistral_cases(),
    "llama3_json": llama3_json_cases(),
    "pythonic": pythonic_cases(),
}


def check_split(
    case: Case,
    pieces: list[str],
    tool_format: ToolCallFormat | None,
    reasoning_format: ReasoningFormat | None = None,
) -> None:
    assert "".join(pieces) == case.text
    streamed = parse(pieces, tool_format, reasoning_format)
    whole = parse([case.text], tool_format, reasoning_format)
    expected = (case.content, case.reasoning, case.calls)
    assert (whole.content, whole.reasoning, whole.calls) == expected
    assert (streamed.content, streamed.reasoning, streamed.calls) == expected
    consumed = [c for _, c in streamed.progress]
    assert consumed == sorted(consumed), "what is decided stays decided"
    assert all(0 <= c <= fed for fed, c in streamed.progress)


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_split_parses_like_the_whole_output(name: str, data: st.DataObject) -> None:
    case = data.draw(CASES[name])
    check_split(case, data.draw(splits(case.text)), FORMATS[name])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_reasoning_then_tool_calls_at_any_split(data: st.DataObject) -> None:
    case = data.draw(hermes_cases(think=True))
    check_split(case, data.draw(splits(case.text)), HERMES, THINK)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_reasoning_alone_at_any_split(data: st.DataObject) -> None:
    case = data.draw(hermes_cases(think=True))
    # without a tool parser, calls are content: everything but reasoning is
    reasoning = [raw for kind, raw in case.pieces if kind == "think" or raw.startswith("<think>")]
    content = "".join(raw for _, raw in case.pieces if raw not in reasoning)
    plain = Case(pieces=case.pieces, content=content, reasoning=case.reasoning)
    check_split(plain, data.draw(splits(case.text)), None, THINK)


@pytest.mark.parametrize(
    ("think", "tools"),
    [(False, True), (True, True), (True, False)],
    ids=["hermes", "think+hermes", "think"],
)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_exactly_the_possible_markup_is_withheld(
    think: bool, tools: bool, data: st.DataObject
) -> None:
    """No fixed holdback: text that cannot be part of a marker or an open call is
    released by the feed that brings it, and ``consumed`` says exactly where the first
    withheld character is (content mapped back through reasoning blocks)."""
    case = data.draw(hermes_cases(think=think))
    pieces = data.draw(splits(case.text))
    result = parse(pieces, HERMES if tools else None, THINK if think else None)
    for fed, consumed in result.progress:
        expected = decided(case, fed, think=think, tools=tools)
        assert consumed == expected, (case.text[:fed], consumed, expected)


SAMPLES = {
    "hermes": 'Hé ☀️ <tool_call>\n{"name": "f", "arguments": {"a": "日本"}}\n</tool_call>'
    '<tool_call>{"name": "f"</tool_call> end',
    "mistral": 'ok [TOOL_CALLS] [{"name": "f", "arguments": {"a": "]\\""}}] tail [TOOL_CALLS]x',
    "llama3_json": '<|python_tag|>{"name": "f", "parameters": {"a": "}"}}; {"name": "f", '
    '"arguments": {}}',
    "pythonic": '[f(a="]\\"", b=[1, {"c": None}]), ns.lookup()]',
}


@pytest.mark.parametrize("name", FORMATS)
def test_every_cut_of_a_sample_parses_alike(name: str) -> None:
    """At every position (two pieces, three pieces), and one character at a time."""
    text = SAMPLES[name]
    whole = parse([text], FORMATS[name])
    assert whole.calls, "the sample has calls"
    expected = (whole.content, whole.calls)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text)) for j in range(i, i + 4)]
    cuts.append(list(text))
    for pieces in cuts:
        result = parse(pieces, FORMATS[name])
        assert (result.content, result.calls) == expected, pieces


def test_text_that_cannot_be_a_marker_is_released_at_once() -> None:
    parser = ChoiceParser(None, HERMES.parser(TOOLS))
    assert parser.feed("Hello <to").content == "Hello "
    assert parser.fed - parser.consumed == 3
    assert parser.feed("x").content == "<tox"
    assert parser.consumed == parser.fed
    assert parser.feed("日本<").content == "日本"
    assert parser.feed("tool_call>").content == ""
    assert parser.fed - parser.consumed == len(MARKER)
    assert not parser.feed('{"name": "f"}').calls
    parsed = parser.feed("</tool_call>☀️")
    assert (parsed.content, [call.name for call in parsed.calls]) == ("☀️", ["f", None])
    assert parser.consumed == parser.fed


def test_a_call_comes_out_in_openais_streaming_shape() -> None:
    parser = HERMES.parser(TOOLS)
    parsed = parser.feed('<tool_call>{"arguments": {"city":"Paris"}, "name": "get_weather"}')
    assert not parsed.calls
    head, arguments = parser.feed("</tool_call>").calls
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "")
    assert head.id is not None
    assert re.fullmatch(r"call_[0-9a-f]{24}", head.id)
    assert (arguments.index, arguments.id, arguments.name) == (0, None, None)
    assert arguments.arguments == '{"city": "Paris"}'  # serialized again, key order kept
    second = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>').calls
    assert [call.index for call in second] == [1, 1]
    assert second[0].id != head.id


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('{"name": "launch_rockets", "arguments": {}}', "not an offered tool"),
        ('{"name": "f", "arguments": 3}', "arguments not an object"),
        ('{"name": "f", "arguments": {"x": NaN}}', "NaN is not JSON"),
        ('{"name": 3, "arguments": {}}', "name not a string"),
        ('{"name": "f", "arguments": {}', "truncated"),
        ('[{"name": "f"}, {"name": "nope"}]', "one bad call spoils the body"),
        ('{"arguments": {}}', "no name"),
    ],
)
def test_a_malformed_body_is_content_verbatim(body: str, why: str) -> None:
    text = f"a <tool_call>{body}</tool_call> b"
    result = parse(list(text), HERMES)
    assert (result.content, result.calls) == (text, []), why


def test_lenient_readings() -> None:
    """Arguments as a JSON string, omitted arguments, a list of calls in one body, an
    unterminated last call, any name when no tools are given."""
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse([text], HERMES).calls == [("f", '{"x": 1}')]
    assert parse(['<tool_call>{"name": "f"}</tool_call>'], HERMES).calls == [("f", "{}")]
    text = '<tool_call>[{"name": "f"}, {"name": "get_weather", "arguments": {}}]</tool_call>'
    assert [name for name, _ in parse([text], HERMES).calls] == ["f", "get_weather"]
    assert parse(['x<tool_call>{"name": "f"}\n'], HERMES).calls == [("f", "{}")]
    assert parse(['<tool_call>{"name": "any"}</tool_call>'], HERMES, tools=()).calls == [
        ("any", "{}")
    ]


def test_mistral_marker_without_a_value_is_content() -> None:
    result = parse(["[TOOL_CALLS] ", "hello [TOOL_CALLS][]"], MISTRAL)
    assert (result.content, result.calls) == ("[TOOL_CALLS] hello [TOOL_CALLS][]", [])


def test_llama3_json_decides_on_the_first_character() -> None:
    parser = LLAMA3_JSON.parser(TOOLS)
    assert parser.feed(" \n").content == ""
    assert parser.feed("Sure").content == " \nSure"
    assert parser.held == 0
    parser = LLAMA3_JSON.parser(TOOLS)
    assert parser.feed('{"name": "f", ').content == ""
    assert parser.held == len('{"name": "f", ')


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ("[f()]", [("f", "{}")]),
        (
            "[ns.lookup(q='日本', n=-1.5, flags=(1, 2))]",
            [("ns.lookup", '{"q": "日本", "n": -1.5, "flags": [1, 2]}')],
        ),
        ("[f(x={'a': [True, None]})]", [("f", '{"x": {"a": [true, null]}}')]),
        ("[f(1)]", []),
        ("[f(x=open('/etc/passwd'))]", []),
        ("[f(**kw)]", []),
        ("[f(x={1, 2})]", []),
        ("[f(x=b'1')]", []),
        ("[g(x=1)]", []),
        ("[f]", []),
        ("[f(x=1) f(y=2)]", []),
    ],
)
def test_pythonic_reads_literals_and_nothing_else(text: str, calls: list[tuple[str, str]]) -> None:
    result = parse(list(text), PYTHONIC)
    assert result.calls == calls
    assert result.content == ("" if calls else text)


def test_reasoning_markers_and_an_unterminated_block() -> None:
    result = parse(list("<think>a <tool_call></think>b<think>c</thi"), HERMES, THINK)
    assert (result.reasoning, result.content, result.calls) == ("a <tool_call>c</thi", "b", [])
    opened = MarkerReasoningFormat(starts_in_reasoning=True)
    result = parse(list("plan</think>answer <think"), None, opened)
    assert (result.reasoning, result.content) == ("plan", "answer <think")


def test_a_call_may_span_a_reasoning_block() -> None:
    """Tool calls are read from the content that remains once reasoning is taken out."""
    text = '<tool_<think>hm</think>call>{"name": "f"}</tool_call>'
    for pieces in ([text], list(text)):
        result = parse(pieces, HERMES, THINK)
        assert (result.reasoning, result.content, result.calls) == ("hm", "", [("f", "{}")])


def test_checked_calls() -> None:
    assert checked_calls([("f", {"b": 1, "a": "é"})], TOOLS) == [("f", '{"b": 1, "a": "é"}')]
    assert checked_calls([], TOOLS) is None
    assert checked_calls([("f", "not json")], TOOLS) is None
    assert checked_calls([("f", {"x": float("inf")})], TOOLS) is None


WEATHER = TOOLS[0]
TIME = Tool(name="get_time")


def test_hermes_constraint() -> None:
    one = HERMES.constraint([WEATHER], parallel=False, param="tool_choice")
    assert one == Constraint(
        param="tool_choice",
        json_schema={
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
            "required": ["name", "arguments"],
        },
        prefix="<tool_call>\n",
        suffix="\n</tool_call>",
        repeat=False,
        separator="\n",
    )
    both = HERMES.constraint([WEATHER, TIME], parallel=True, param="tool_choice")
    assert both is not None
    assert both.repeat
    assert both.json_schema is not None
    options = both.json_schema["anyOf"]
    assert [option["properties"]["name"] for option in options] == [
        {"const": "get_weather"},
        {"const": "get_time"},
    ]
    assert options[1]["properties"]["arguments"] == {"type": "object"}
    json.dumps(both.json_schema)  # plain JSON data


def test_mistral_llama_and_pythonic_constraints() -> None:
    single = MISTRAL.constraint([TIME], parallel=False, param="p")
    assert single is not None
    assert single.prefix == "[TOOL_CALLS]"
    assert single.json_schema is not None
    assert (single.json_schema["type"], single.json_schema["maxItems"]) == ("array", 1)
    parallel = MISTRAL.constraint([TIME], parallel=True, param="p")
    assert parallel is not None
    assert parallel.json_schema is not None
    assert "maxItems" not in parallel.json_schema
    assert not parallel.repeat
    llama = LLAMA3_JSON.constraint([TIME], parallel=True, param="p")
    assert llama is not None
    assert llama.json_schema is not None
    assert (llama.prefix, llama.repeat, llama.separator) == ("", True, "; ")
    assert llama.json_schema["required"] == ["name", "parameters"]
    assert PYTHONIC.constraint([TIME], parallel=False, param="p") is None
    assert HERMES.constraint([], parallel=False, param="p") is None


def test_a_marker_format_in_one_line_and_a_custom_body_in_one_method() -> None:
    angles = MarkerToolFormat(start="<<", end=">>", name="angles")
    result = parse(list('a <<{"name": "f", "arguments": {"x": 1}}>> b'), angles)
    assert (result.content, result.calls) == ("a  b", [("f", '{"x": 1}')])

    class FunctionTags(MarkerToolFormat):
        """``<function=NAME>{arguments}</function>``: the name is in the marker's tail."""

        def read_body(self, body: str) -> list[tuple[object, object]] | None:
            name, _, arguments = body.partition(">")
            try:
                return [(name, json.loads(arguments))]
            except ValueError:
                return None

    tags = FunctionTags(start="<function=", end="</function>", name="function_tags")
    result = parse(list('<function=f>{"x": 2}</function>'), tags)
    assert result.calls == [("f", '{"x": 2}')]


def test_a_failing_user_reader_shows_the_text(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(MarkerToolFormat):
        def read_body(self, body: str) -> list[tuple[object, object]] | None:
            raise KeyError(body)

    text = 'a <call>{"name": "f"}</call>'
    result = parse(list(text), Broken(start="<call>", end="</call>", name="broken"))
    assert (result.content, result.calls) == (text, [])
    assert "broken: read_body failed" in caplog.text


def test_formats_refuse_empty_markers() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        MarkerToolFormat(start="")
    with pytest.raises(ValueError, match="non-empty"):
        MarkerToolFormat(start="<a>", end="")
    with pytest.raises(ValueError, match="non-empty"):
        MarkerReasoningFormat(end="")
