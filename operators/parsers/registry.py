"""Parsers by name: what ``--tool-call-parser NAME`` and ``--reasoning-parser NAME`` (and
``default_graph(tool_call_parser="hermes")``) look up.

The built-ins are registered here; a user's format is registered the same way, from
Python, before the graph is built::

    register_tool_parser("mine", MarkerToolFormat(start="<call>", end="</call>", name="mine"))
    app = build_app(engine, tokenizer, model_name="m", tool_call_parser="mine")

A later registration under a taken name replaces the earlier one, so a built-in can be
swapped for a fixed version without touching the code that names it.
"""

from __future__ import annotations

from typing import Final

from .base import ReasoningFormat, ToolCallFormat
from .leading import JsonToolFormat, PythonicToolFormat
from .marker import MarkerToolFormat
from .reasoning import MarkerReasoningFormat

__all__ = (
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "PYTHONIC",
    "THINK",
    "reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
    "register_tool_parser",
    "tool_parser",
    "tool_parser_names",
)

#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen, SmolLM's
#: shipped tool template)
HERMES: Final = MarkerToolFormat(start="<tool_call>", end="</tool_call>", name="hermes")
#: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral)
MISTRAL: Final = MarkerToolFormat(start="[TOOL_CALLS]", end=None, name="mistral")
#: ``{"name": ..., "parameters": {...}}`` as the whole output, ``;`` between calls (Llama 3)
LLAMA3_JSON: Final = JsonToolFormat()
#: ``[get_weather(city="Paris"), ...]`` as the whole output (Llama 3.2 and 4, others)
PYTHONIC: Final = PythonicToolFormat()
#: ``<think>...</think>`` (DeepSeek R1, Qwen 3, SmolLM 3)
THINK: Final = MarkerReasoningFormat()

_TOOL_FORMATS: dict[str, ToolCallFormat] = {}
_REASONING_FORMATS: dict[str, ReasoningFormat] = {}


def register_tool_parser(name: str, tool_format: ToolCallFormat) -> None:
    """Make ``tool_format`` available as ``name`` (replacing any earlier one).

    Raises:
        ValueError: ``name`` is empty.
        TypeError: ``tool_format`` has no ``parser`` or ``constraint`` method.
    """
    _check(name, tool_format, ("parser", "constraint"))
    _TOOL_FORMATS[name] = tool_format


def tool_parser(name: str) -> ToolCallFormat:
    """The tool-call format registered as ``name``.

    Raises:
        ValueError: nothing is registered as ``name`` (the message lists what is).
    """
    found = _TOOL_FORMATS.get(name)
    if found is None:
        raise ValueError(_unknown("tool-call parser", name, tool_parser_names()))
    return found


def tool_parser_names() -> tuple[str, ...]:
    """The registered tool-call format names, sorted."""
    return tuple(sorted(_TOOL_FORMATS))


def register_reasoning_parser(name: str, reasoning_format: ReasoningFormat) -> None:
    """Make ``reasoning_format`` available as ``name`` (replacing any earlier one).

    Raises:
        ValueError: ``name`` is empty.
        TypeError: ``reasoning_format`` has no ``parser`` method.
    """
    _check(name, reasoning_format, ("parser",))
    _REASONING_FORMATS[name] = reasoning_format


def reasoning_parser(name: str) -> ReasoningFormat:
    """The reasoning format registered as ``name``.

    Raises:
        ValueError: nothing is registered as ``name`` (the message lists what is).
    """
    found = _REASONING_FORMATS.get(name)
    if found is None:
        raise ValueError(_unknown("reasoning parser", name, reasoning_parser_names()))
    return found


def reasoning_parser_names() -> tuple[str, ...]:
    """The registered reasoning format names, sorted."""
    return tuple(sorted(_REASONING_FORMATS))


def _check(name: str, value: object, methods: tuple[str, ...]) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a parser name must be a non-empty string, got {name!r}")
    missing = [method for method in methods if not callable(getattr(value, method, None))]
    if missing:
        raise TypeError(f"{value!r} is not a parser format: it has no {', '.join(missing)}()")


def _unknown(kind: str, name: str, known: tuple[str, ...]) -> str:
    return f"unknown {kind} {name!r}; registered: {', '.join(known) or 'none'}"


for _name, _format in (
    ("hermes", HERMES),
    ("mistral", MISTRAL),
    ("llama3_json", LLAMA3_JSON),
    ("pythonic", PYTHONIC),
):
    register_tool_parser(_name, _format)
register_reasoning_parser("think", THINK)
