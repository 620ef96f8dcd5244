"""Tool calls that are the whole output: ``llama3_json`` and ``pythonic``.

These models answer either with text or with calls and nothing else, so there is no
marker to look for in the middle of text: the first characters decide.

* ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}`` (``"arguments"``
  is accepted too), possibly after ``<|python_tag|>``; several are separated by ``;``.
* ``pythonic``: a Python list of calls, ``[get_weather(city="Paris"), f(x=1)]``, read with
  :mod:`ast`: keyword arguments with literal values only, nothing is ever evaluated.

Leading whitespace is withheld until the first other character; an output that does not
open like a call is then content from there on, released as it comes. One that does is
withheld until its value closes (brackets counted outside strings), then emitted as calls,
or shown as content when it is not valid calls. Whitespace (and ``;``) after calls is
part of the call syntax and swallowed; another call may follow, anything else is content.
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from operators.contracts.llm import Constraint

from .base import Parsed, call_pieces, checked_calls
from .marker import calls_schema, read_json_calls
from .scan import BracketScanner

if TYPE_CHECKING:
    from operators.contracts.llm import Tool, ToolCallDelta

__all__ = ("JsonToolFormat", "LeadingToolParser", "PythonicToolFormat", "read_python_calls")

logger = logging.getLogger(__name__)

_LEAD: Final = 0  # before the first call: whitespace (and the tag) withheld
_BODY: Final = 1  # inside a call's value
_AFTER: Final = 2  # after a call: separators withheld
_PLAIN: Final = 3  # content from here on


@dataclass(frozen=True, slots=True)
class JsonToolFormat:
    """Calls as JSON objects making up the whole output, optionally after ``tag``,
    separated by ``;`` (Llama 3's JSON tool calling)."""

    name: str = "llama3_json"
    tag: str = "<|python_tag|>"
    arguments_keys: tuple[str, ...] = ("parameters", "arguments")

    def parser(self, tools: Sequence[Tool], /) -> LeadingToolParser:
        """A parser for one choice."""
        return LeadingToolParser(
            self.name,
            tools,
            opener="{",
            tag=self.tag,
            separators=";",
            quotes='"',
            read=lambda body: read_json_calls(body, self.arguments_keys),
        )

    def constraint(self, tools: Sequence[Tool], *, parallel: bool, param: str) -> Constraint | None:
        """A call object (with ``"parameters"``), repeated with ``"; "`` when ``parallel``."""
        if not tools:
            return None
        schema = calls_schema(tools, self.arguments_keys[0])
        return Constraint(param=param, json_schema=schema, repeat=parallel, separator="; ")


@dataclass(frozen=True, slots=True)
class PythonicToolFormat:
    """Calls as a Python list of function calls making up the whole output."""

    name: str = "pythonic"

    def parser(self, tools: Sequence[Tool], /) -> LeadingToolParser:
        """A parser for one choice."""
        return LeadingToolParser(
            self.name,
            tools,
            opener="[",
            tag="",
            separators="",
            quotes="\"'",
            read=read_python_calls,
        )

    def constraint(self, tools: Sequence[Tool], *, parallel: bool, param: str) -> Constraint | None:
        """None: a Python expression is not a JSON value, so this format cannot be forced
        (``tool_choice: "required"`` is refused rather than ignored)."""
        return None


def read_python_calls(body: str) -> list[tuple[object, object]] | None:
    """``(name, arguments)`` of each call in a Python list of calls, or None.

    Each element must be a call of a (dotted) name with keyword arguments whose values
    are literals (:func:`ast.literal_eval`): nothing in the model's output is executed.
    """
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls: list[tuple[object, object]] = []
    for element in tree.body.elts:
        if not isinstance(element, ast.Call) or element.args:
            return None
        name = _dotted(element.func)
        arguments: dict[str, Any] = {}
        for keyword in element.keywords:
            if keyword.arg is None:  # **mapping
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append((name, arguments))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


class LeadingToolParser:
    """One choice's parser for calls that make up the whole output (see the module).

    ``opener`` starts a call's value (after whitespace and, optionally, ``tag``);
    ``separators`` (besides whitespace) may come between calls; ``quotes`` delimit strings
    inside a value; ``read`` turns a complete value into ``(name, arguments)`` pairs.
    """

    __slots__ = (
        "_brackets",
        "_calls",
        "_held",
        "_name",
        "_opener",
        "_quotes",
        "_read",
        "_separators",
        "_state",
        "_tag",
        "_tag_pos",
        "_tools",
        "held",
    )

    def __init__(
        self,
        name: str,
        tools: Sequence[Tool],
        *,
        opener: str,
        tag: str,
        separators: str,
        quotes: str,
        read: Callable[[str], list[tuple[object, object]] | None],
    ) -> None:
        self._name = name
        self._tools = tuple(tools)
        self._opener = opener
        self._tag = tag
        self._separators = separators
        self._quotes = quotes
        self._read = read
        self._state = _LEAD
        self._tag_pos = 0  # characters of the tag seen (only before the first call)
        self._held: list[str] = []  # withheld text: lead or separators, then the value
        #: characters withheld: leading whitespace, an open call, separators
        self.held = 0
        self._brackets = BracketScanner(quotes)
        self._calls = 0

    def feed(self, text: str, /) -> Parsed:
        """Take the next text; return content and call pieces that may be shown now."""
        if self._state == _PLAIN:
            return Parsed(text)
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while text:
            state = self._state
            if state == _PLAIN:
                content.append(text)
                break
            if state == _BODY:
                stop = self._brackets.end(text)
                if stop < 0:
                    self._hold(text)
                    break
                self._hold(text[:stop])
                self._close(content, calls)
                text = text[stop:]
                continue
            start = self._skip(text)
            if start < 0:  # all of it may still lead to a call
                self._hold(text)
                break
            self._hold(text[:start])
            text = text[start:]
            if text[0] == self._opener:
                self._state = _BODY
            else:
                content.append(self._release())
                self._state = _PLAIN
        return Parsed("".join(content), "", calls)

    def finish(self) -> Parsed:
        """Release what is withheld: an open value as calls if it is already valid,
        trailing separators nowhere, anything else as content."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self._state == _BODY:
            self._close(content, calls)
        elif self._state == _LEAD:
            content.append(self._release())
        self._release()  # (separators after calls)
        self._state = _PLAIN
        return Parsed("".join(content), "", calls)

    def _skip(self, text: str) -> int:
        """Where, in ``text``, a call's value opens or something else starts (what
        follows decides); -1 when all of ``text`` may still precede a value."""
        tag = self._tag if self._state == _LEAD else ""
        position = self._tag_pos
        separators = self._separators if self._state == _AFTER else ""
        for i, char in enumerate(text):
            if 0 < position < len(tag):  # inside the tag
                if char != tag[position]:
                    return i
                position += 1
            elif char.isspace() or char in separators:
                continue
            elif position == 0 and tag and char == tag[0]:
                position = 1
            else:
                return i
            self._tag_pos = position
        return -1

    def _hold(self, text: str) -> None:
        if text:
            self._held.append(text)
            self.held += len(text)

    def _release(self) -> str:
        text = "".join(self._held)
        self._held = []
        self.held = 0
        return text

    def _close(self, content: list[str], calls: list[ToolCallDelta]) -> None:
        """The value closed (or the output ended inside it): its calls, after which
        separators and another call may follow; or else all the text withheld, as content,
        and everything after it is content too."""
        text = self._release()
        body = text[text.index(self._opener) :] if self._opener in text else text
        try:
            found = self._read(body)
        except Exception:  # a user's reader: a bug there must not fail the answer
            logger.exception("%s: reading a call failed; shown as content", self._name)
            found = None
        checked = None if found is None else checked_calls(found, self._tools)
        if checked is None:
            # (debug, not a warning: text that merely opens with a bracket lands here)
            logger.debug("%s: %r is not a valid call; it is shown as content", self._name, body)
            content.append(text)
            self._state = _PLAIN
            return
        for name, arguments in checked:
            calls.extend(call_pieces(self._calls, name, arguments))
            self._calls += 1
        self._state = _AFTER
        self._brackets = BracketScanner(self._quotes)
