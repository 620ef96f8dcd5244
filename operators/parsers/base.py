"""The vocabulary of output parsers: what a format is, what a per-choice parser does.

A *format* is a stateless, shareable description (the ``hermes`` spelling of tool calls,
``<think>`` reasoning); it makes one sans-IO *parser* per choice. A parser is fed the
choice's text as the Backend releases it and answers with what may be shown now
(:class:`Parsed`): content, reasoning, tool-call pieces. It never sees tokens, an event
loop or a Context, so it is tested by feeding strings, and the operator
(:class:`~operators.parsers.operator.OutputParsers`) adapts it to a stream.

A parser withholds text that may still turn out to be markup -- a marker split across
feeds, a call whose body is not complete yet -- and reports how much through ``held``:
the operator needs it to say which tokens the client has seen (``delivered_tokens``), so
that logprobs never run ahead of the text.

Tool calls come out in OpenAI's streaming shape (:func:`call_pieces`): a first piece with
the call's index, id and name and ``arguments=""``, then the arguments' JSON text.
:func:`checked_calls` turns what a format read (names and argument objects) into those
arguments, or says the body is not a valid call, in which case the parser shows the
original text as content: a model that botched a call is answered, not a 500.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from operators.contracts.llm import ToolCallDelta

if TYPE_CHECKING:
    from operators.contracts.llm import Constraint, Tool

__all__ = (
    "Parsed",
    "ReasoningFormat",
    "ReasoningParser",
    "ToolCallFormat",
    "ToolParser",
    "call_pieces",
    "checked_calls",
    "new_call_id",
)


@dataclass(slots=True)
class Parsed:
    """What one feed (or the finish) of a parser releases. Each kind is in the order of
    the text; between kinds the order within one feed is not kept (OpenAI's deltas carry
    content, reasoning and calls apart, and clients assemble each on its own)."""

    content: str = ""
    reasoning: str = ""
    #: (a sequence, not a list: one is made per token, and ``()`` costs nothing)
    calls: Sequence[ToolCallDelta] = ()


class ToolParser(Protocol):
    """One choice's tool-call parser: content text in, content and call pieces out."""

    @property
    def held(self) -> int:
        """How many of the characters fed so far are withheld (not released as content,
        not part of an emitted call): always a tail of what was fed."""
        ...

    def feed(self, text: str, /) -> Parsed:
        """Take the next text of the choice; return what may be shown now."""
        ...

    def finish(self) -> Parsed:
        """The choice ended: release everything still withheld (``held`` becomes 0)."""
        ...


class ToolCallFormat(Protocol):
    """How a model family spells tool calls: a parser per choice, and the constraint that
    forces calls (``tool_choice: "required"`` or a named function)."""

    @property
    def name(self) -> str:
        """A label for logs and errors."""
        ...

    def parser(self, tools: Sequence[Tool], /) -> ToolParser:
        """A fresh parser for one choice of a request offering ``tools`` (empty: calls of
        any name are accepted)."""
        ...

    def constraint(self, tools: Sequence[Tool], *, parallel: bool, param: str) -> Constraint | None:
        """The output constraint that makes the model call one of ``tools`` (several
        calls when ``parallel``), reported as ``param`` when refused; None when calls in
        this format cannot be expressed as a constraint (the request is then a 400)."""
        ...


class ReasoningParser(Protocol):
    """One choice's reasoning parser: raw text in, reasoning and content out.

    Tool-call parsing runs on its content, so it also maps content back to the raw text:
    the operator needs to know which raw characters a tool parser still withholds.
    """

    @property
    def held(self) -> int:
        """How many of the characters fed so far are withheld (a tail of them)."""
        ...

    def feed(self, text: str, /) -> Parsed:
        """Take the next raw text; return reasoning and content that may be shown now."""
        ...

    def finish(self) -> Parsed:
        """The choice ended: release everything withheld."""
        ...

    def source_offset(self, content_offset: int, /) -> int:
        """Where, in the raw text fed so far, the content character numbered
        ``content_offset`` (counting all content released so far from 0) came from.

        Only asked for characters already released, with offsets that never decrease.
        """
        ...


class ReasoningFormat(Protocol):
    """How a model family marks its reasoning: a parser per choice."""

    @property
    def name(self) -> str:
        """A label for logs and errors."""
        ...

    def parser(self) -> ReasoningParser:
        """A fresh parser for one choice."""
        ...


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's spelling: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def call_pieces(index: int, name: str, arguments: str) -> list[ToolCallDelta]:
    """A complete call as OpenAI streams one: its head (index, a new id, the name,
    ``arguments=""``), then its arguments' JSON text as one fragment."""
    return [ToolCallDelta(index, "", new_call_id(), name), ToolCallDelta(index, arguments)]


def checked_calls(
    calls: Iterable[tuple[object, object]], tools: Sequence[Tool]
) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON text)`` for each ``(name, arguments)`` a format read, or
    None when any of them is not a valid call (the parser then shows the text instead).

    A valid call names a function of ``tools`` (any name when ``tools`` is empty) and has
    a JSON object as arguments (None counts as ``{}``; a string holding a JSON object, as
    some models write it, counts as that object). The arguments are serialized again, so
    a streamed and a non-streamed answer say exactly the same thing whatever spacing the
    model used.
    """
    names = {tool.name for tool in tools}
    checked: list[tuple[str, str]] = []
    for name, arguments in calls:
        if not isinstance(name, str) or not name or (names and name not in names):
            return None
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        try:
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):  # not JSON: NaN (json.loads reads it), a set, bytes
            return None
        checked.append((name, text))
    return checked or None
