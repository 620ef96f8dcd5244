"""One choice's parsers chained: reasoning first, then tool calls on what is content.

:class:`ChoiceParser` is still sans-IO (strings in, :class:`~.base.Parsed` out); it adds
the one thing the operator needs beyond the two parsers: how far into the choice's text
everything has been decided (:attr:`ChoiceParser.consumed`), so that a token counts as
delivered exactly when the text it starts with has been shown, moved into reasoning or a
call, or swallowed as markup.

The tool parser withholds a tail of the *content*; with a reasoning parser in front,
content is not a tail of the raw text (a ``</think>`` may sit between), so the reasoning
parser maps the tool parser's first withheld content character back to the raw text
(:meth:`~.base.ReasoningParser.source_offset`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Parsed

if TYPE_CHECKING:
    from operators.contracts.llm import ToolCallDelta

    from .base import ReasoningParser, ToolParser

__all__ = ("ChoiceParser",)


class ChoiceParser:
    """A reasoning parser and a tool parser (either may be None) for one choice."""

    __slots__ = ("_content", "_reasoning", "_tools", "fed")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        #: characters of raw text fed so far
        self.fed = 0
        self._content = 0  # characters the reasoning parser passed to the tool parser

    @property
    def consumed(self) -> int:
        """How many characters of the raw text fed are decided (shown, moved or swallowed):
        everything before the first character any parser withholds."""
        tools, reasoning = self._tools, self._reasoning
        if tools is not None:
            held = tools.held
            if held:
                if reasoning is None:
                    return self.fed - held
                return reasoning.source_offset(self._content - held)
        if reasoning is not None:
            return self.fed - reasoning.held
        return self.fed

    def feed(self, text: str) -> Parsed:
        """Take the choice's next raw text; return what may be shown now."""
        self.fed += len(text)
        reasoning, tools = self._reasoning, self._tools
        if reasoning is None:
            return tools.feed(text) if tools is not None else Parsed(text)
        parsed = reasoning.feed(text)
        if tools is not None and parsed.content:
            self._content += len(parsed.content)
            called = tools.feed(parsed.content)
            parsed.content = called.content
            parsed.calls = called.calls
        return parsed

    def finish(self) -> Parsed:
        """The choice ended: release everything withheld, in order."""
        reasoning, tools = self._reasoning, self._tools
        if reasoning is None:
            return tools.finish() if tools is not None else Parsed()
        parsed = reasoning.finish()
        if tools is not None:
            content: list[str] = []
            calls: list[ToolCallDelta] = []
            if parsed.content:
                self._content += len(parsed.content)
                fed = tools.feed(parsed.content)
                content.append(fed.content)
                calls.extend(fed.calls)
            rest = tools.finish()
            content.append(rest.content)
            calls.extend(rest.calls)
            parsed.content = "".join(content)
            parsed.calls = calls
        return parsed
