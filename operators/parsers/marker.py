"""Tool calls between markers: ``hermes`` (``<tool_call>{...}</tool_call>``), ``mistral``
(``[TOOL_CALLS][...]``), and any format a user spells the same way.

:class:`MarkerToolFormat` is the reusable base: a start marker, then a JSON body, then an
end marker, or (``end=None``) no end marker, the body ending where its JSON value closes.
Text outside calls is content, before, between and after calls. A new format of this
kind is one line::

    register_tool_parser("mine", MarkerToolFormat(start="<call>", end="</call>", name="mine"))

and a body that is not ``{"name": ..., "arguments": {...}}`` (or a list of those) is one
method: subclass and override :meth:`MarkerToolFormat.read_body`.

A call is emitted once its body is complete, which is what lets a malformed body fall
back to content whole, markers included, as the model wrote it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from operators.contracts.llm import Constraint

from .base import Parsed, call_pieces, checked_calls
from .scan import BracketScanner, MarkerScanner

if TYPE_CHECKING:
    from operators.contracts.llm import Tool, ToolCallDelta

__all__ = ("MarkerToolFormat", "MarkerToolParser", "calls_schema", "read_json_calls")

logger = logging.getLogger(__name__)


def read_json_calls(body: str, arguments_keys: Sequence[str]) -> list[tuple[object, object]] | None:
    """``(name, arguments)`` of each call in a JSON body: one object or a list of them,
    each with ``"name"`` and its arguments under the first of ``arguments_keys`` present
    (an object with only a name has none). None when the body is not that shape."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls: list[tuple[object, object]] = []
    for item in items:
        if not isinstance(item, dict) or "name" not in item:
            return None
        key = next((key for key in arguments_keys if key in item), None)
        if key is None and len(item) > 1:  # arguments under a name we do not know
            return None
        calls.append((item["name"], None if key is None else item[key]))
    return calls


def calls_schema(tools: Sequence[Tool], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call of any of ``tools``: ``{"name": <const>, arguments_key:
    <the tool's parameters schema>}``."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                arguments_key: dict(tool.parameters or {"type": "object"}),
            },
            "required": ["name", arguments_key],
        }
        for tool in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass(frozen=True, slots=True)
class MarkerToolFormat:
    """Tool calls as ``start`` + JSON body + ``end`` (``end=None``: the body ends where its
    JSON value, an object or an array of calls, closes).

    ``arguments_keys`` are where a call object may keep its arguments, first match wins;
    the first is also what the constraint asks the model to write.
    """

    start: str
    end: str | None = None
    name: str = "markers"
    arguments_keys: tuple[str, ...] = ("arguments", "parameters")

    def __post_init__(self) -> None:
        if not self.start or self.end == "":
            raise ValueError("a marker format needs a non-empty start (and end, if any)")
        if not self.arguments_keys:
            raise ValueError("arguments_keys must name at least one key")

    def parser(self, tools: Sequence[Tool], /) -> MarkerToolParser:
        """A parser for one choice."""
        return MarkerToolParser(self, tools)

    def read_body(self, body: str) -> list[tuple[object, object]] | None:
        """``(name, arguments)`` of the calls in one body (the text between the markers),
        or None when it is not calls. Override for bodies that are not JSON call objects."""
        return read_json_calls(body, self.arguments_keys)

    def constraint(self, tools: Sequence[Tool], *, parallel: bool, param: str) -> Constraint | None:
        """``start`` + a call + ``end`` (repeated, joined by newlines, when ``parallel``);
        without an end marker, ``start`` + a JSON array of calls (one unless ``parallel``).
        """
        if not tools:
            return None
        schema = calls_schema(tools, self.arguments_keys[0])
        if self.end is None:
            array: dict[str, Any] = {"type": "array", "items": schema, "minItems": 1}
            if not parallel:
                array["maxItems"] = 1
            return Constraint(param=param, json_schema=array, prefix=self.start)
        return Constraint(
            param=param,
            json_schema=schema,
            prefix=self.start + "\n",
            suffix="\n" + self.end,
            repeat=parallel,
            separator="\n",
        )


class MarkerToolParser:
    """One choice's parser for a :class:`MarkerToolFormat`.

    Outside a call it withholds only a possible start marker; inside one it withholds
    everything until the body is complete, then emits the calls, or releases the whole
    text as content when the body is not valid calls of the offered tools.
    """

    __slots__ = (
        "_body",
        "_body_len",
        "_brackets",
        "_calls",
        "_format",
        "_gap",
        "_gap_before_body",
        "_in_body",
        "_scanner",
        "_tail",
        "_tools",
        "held",
    )

    def __init__(self, tool_format: MarkerToolFormat, tools: Sequence[Tool]) -> None:
        self._format = tool_format
        self._tools = tuple(tools)
        self._scanner = MarkerScanner((tool_format.start,))
        self._calls = 0  # calls emitted (the next one's index)
        self._in_body = False
        self._body: list[str] = []  # the body so far, in pieces
        self._body_len = 0
        self._tail = ""  # the body's last len(end) - 1 characters (an end marker may span)
        #: without an end marker: the body's JSON value, once its first bracket came
        self._brackets: BracketScanner | None = None
        #: whitespace after the last call, withheld: it is dropped if only calls or the
        #: end follow (the newline a model, or a constraint's separator, puts between
        #: calls is not content), and shown with the next text otherwise
        self._gap: str | None = None
        #: the gap that came before the open call's start marker (shown if it is malformed)
        self._gap_before_body = ""
        #: characters withheld: a possible start marker, or the open call so far
        self.held = 0

    def feed(self, text: str, /) -> Parsed:
        """Take the next text; return content and call pieces that may be shown now."""
        if not self._in_body:
            released, marker, text = self._scanner.scan(text)
            if marker is None:
                released = self._outside(released)
                self.held = self._scanner.held + len(self._gap or "")
                return Parsed(released)
            content = [self._outside(released)]
            self._open()
        else:
            content = []
        calls: list[ToolCallDelta] = []
        while text:
            if self._in_body:
                text = self._feed_body(text, content, calls)
            else:
                released, marker, text = self._scanner.scan(text)
                content.append(self._outside(released))
                if marker is not None:
                    self._open()
        if self._in_body:
            self.held = len(self._gap_before_body) + len(self._format.start) + self._body_len
        else:
            self.held = self._scanner.held + len(self._gap or "")
        return Parsed("".join(content), "", calls)

    def finish(self) -> Parsed:
        """Release what is withheld: a partial marker as content; an open call (no end
        marker yet) as calls if its body is already valid, as content otherwise.
        Whitespace after the last call is dropped."""
        self.held = 0
        if not self._in_body:
            text = self._outside(self._scanner.flush())
            self._gap = None
            return Parsed(text)
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        self._close("".join(self._body), "", content, calls)
        self._gap = None
        return Parsed("".join(content), "", calls)

    def _outside(self, released: str) -> str:
        """``released`` text outside calls, minus whitespace withheld after a call."""
        gap = self._gap
        if gap is None or not released:
            return released
        if released.isspace():
            self._gap = gap + released
            return ""
        self._gap = None
        return gap + released

    def _open(self) -> None:
        """A start marker: the whitespace before it belongs to the call, not to content."""
        self._in_body = True
        self._gap_before_body = self._gap or ""
        self._gap = None

    def _feed_body(self, text: str, content: list[str], calls: list[ToolCallDelta]) -> str:
        """Take ``text`` into the open body; the text after the body, once it closed."""
        end = self._format.end
        if end is None:
            return self._feed_value(text, content, calls)
        window = self._tail + text
        found = window.find(end)
        if found < 0:
            self._append(text)
            keep = len(end) - 1
            self._tail = window[-keep:] if keep else ""
            return ""
        cut = found - len(self._tail)  # where the end marker starts in ``text`` (may be < 0)
        body = "".join(self._body) + text
        body = body[: len(body) - len(text) + cut]
        self._close(body, end, content, calls)
        return text[cut + len(end) :]

    def _feed_value(self, text: str, content: list[str], calls: list[ToolCallDelta]) -> str:
        brackets = self._brackets
        start = 0
        if brackets is None:  # still before the value: only whitespace may come first
            start = len(text) - len(text.lstrip())
            if start == len(text):
                self._append(text)
                return ""
            if text[start] not in "[{":
                body = "".join(self._body) + text[:start]
                content.append(self._gap_before_body + self._format.start + body)
                logger.debug("%s: %r not followed by a JSON value", self._format.name, body)
                self._gap_before_body = ""
                self._reset()
                return text[start:]
            brackets = self._brackets = BracketScanner()
        stop = brackets.end(text, start)
        if stop < 0:
            self._append(text)
            return ""
        self._close("".join(self._body) + text[:stop], "", content, calls)
        return text[stop:]

    def _append(self, text: str) -> None:
        self._body.append(text)
        self._body_len += len(text)

    def _close(self, body: str, end: str, content: list[str], calls: list[ToolCallDelta]) -> None:
        """A complete body: its calls, or its text (markers included) as content."""
        try:
            found = self._format.read_body(body)
        except Exception:  # a user's read_body: a bug there must not fail the answer
            logger.exception("%s: read_body failed; shown as content", self._format.name)
            found = None
        checked = None if found is None else checked_calls(found, self._tools)
        if checked is None:
            logger.warning(
                "%s: a tool call body (%d characters) is not a valid call of the offered "
                "tools; it is shown as content",
                self._format.name,
                len(body),
            )
            logger.debug("%s: the body was %r", self._format.name, body)
            content.append(self._gap_before_body + self._format.start + body + end)
        else:
            for name, arguments in checked:
                calls.extend(call_pieces(self._calls, name, arguments))
                self._calls += 1
            self._gap = ""  # whitespace after a call waits to see what follows
        self._gap_before_body = ""
        self._reset()

    def _reset(self) -> None:
        self._in_body = False
        self._body = []
        self._body_len = 0
        self._tail = ""
        self._brackets = None
