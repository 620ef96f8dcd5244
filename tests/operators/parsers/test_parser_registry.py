"""The parser registry: built-ins by name, users' formats added and swapped from Python."""

from __future__ import annotations

import pytest

from operators.parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    THINK,
    MarkerReasoningFormat,
    MarkerToolFormat,
    reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
    register_tool_parser,
    tool_parser,
    tool_parser_names,
)


def test_the_built_ins_are_registered() -> None:
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(tool_parser_names())
    assert tool_parser_names() == tuple(sorted(tool_parser_names()))
    assert [tool_parser(name) for name in ("hermes", "mistral", "llama3_json", "pythonic")] == [
        HERMES,
        MISTRAL,
        LLAMA3_JSON,
        PYTHONIC,
    ]
    assert "think" in reasoning_parser_names()
    assert reasoning_parser("think") is THINK
    for name in ("hermes", "mistral", "llama3_json", "pythonic"):
        assert tool_parser(name).name == name


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'nope'.*hermes.*pythonic"):
        tool_parser("nope")
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope'.*think"):
        reasoning_parser("nope")


def test_users_register_and_replace_formats() -> None:
    mine = MarkerToolFormat(start="<call>", end="</call>", name="registry_test")
    register_tool_parser("registry_test", mine)
    assert tool_parser("registry_test") is mine
    assert "registry_test" in tool_parser_names()
    fixed = MarkerToolFormat(start="<tool_call>", end="</tool_call>", name="hermes")
    register_tool_parser("hermes", fixed)  # a built-in swapped by name
    try:
        assert tool_parser("hermes") is fixed
    finally:
        register_tool_parser("hermes", HERMES)
    thoughts = MarkerReasoningFormat(start="<thought>", end="</thought>", name="thought")
    register_reasoning_parser("registry_test_thought", thoughts)
    assert reasoning_parser("registry_test_thought") is thoughts


def test_registering_something_that_is_not_a_format_fails_at_once() -> None:
    with pytest.raises(TypeError, match="constraint"):
        register_tool_parser("half", THINK)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="parser"):
        register_reasoning_parser("none", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        register_tool_parser("", HERMES)
    assert "half" not in tool_parser_names()
