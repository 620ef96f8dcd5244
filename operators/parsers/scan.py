"""Two incremental scanners the parsers are built from: markers, and bracketed values.

Both are fed a stream in arbitrary pieces and decide exactly as they would on the whole
text at once, which is what makes a parser's output independent of how the model's text
was cut into tokens. Each costs O(len(piece)) per feed, whatever came before.

* :class:`MarkerScanner` finds marker strings (``<tool_call>``, ``<think>``) with the stop
  jail's automaton (:class:`~operators.text.stop_jail.StopJail`): it withholds exactly the tail
  that may still grow into a marker, and nothing when no marker can start there, so plain
  text passes at once and a split marker never leaks a byte.
* :class:`BracketScanner` finds where a JSON value (or a Python list) that started with a
  bracket ends, skipping brackets inside strings: a call body with no end marker
  (``[TOOL_CALLS][...]``) ends there.
"""

from __future__ import annotations

import re
from typing import Final

from operators.text.stop_jail import Released, StopJail, Stopped

__all__ = ("BracketScanner", "MarkerScanner")

_OPENERS: Final = "[{("
_CLOSERS: Final = "]})"
_SPECIAL: Final = re.compile(r"""[\[\]{}()"'\\]""")


class MarkerScanner:
    """Finds the first of ``markers`` in a stream, withholding what may still be one."""

    __slots__ = ("_jail", "_markers", "held")

    def __init__(self, markers: tuple[str, ...]) -> None:
        if not markers or not all(markers):
            raise ValueError(f"markers must be non-empty strings, got {markers!r}")
        self._markers = markers
        self._jail = StopJail(markers)
        #: how many characters fed so far are withheld (``len(withheld)``, kept as a count
        #: because the parsers ask for it after every feed)
        self.held = 0

    @property
    def withheld(self) -> str:
        """The tail fed so far that may still become a marker."""
        return self._jail.withheld

    def scan(self, text: str) -> tuple[str, str | None, str]:
        """Feed ``text``: ``(released, marker, rest)``.

        Without a marker completing, ``released`` is what can no longer be part of one
        (``marker`` None, ``rest`` ""). When one completes, ``released`` is everything
        before it, ``marker`` is the marker and ``rest`` is the part of ``text`` after it,
        not scanned yet; the scanner starts afresh (call again with ``rest``).
        """
        held = self.held
        result = self._jail.push(text)
        if type(result) is Released:
            released = result.text
            self.held = held + len(text) - len(released)
            return released, None, ""
        assert isinstance(result, Stopped)
        marker = result.stop
        # The match ends inside ``text`` (it would have completed earlier otherwise):
        # ``released + marker`` is a prefix of ``withheld + text``.
        end = len(result.text) + len(marker) - held
        self._jail = StopJail(self._markers)  # a jail that matched takes no more text
        self.held = 0
        return result.text, marker, text[end:]

    def flush(self) -> str:
        """End of stream: the withheld tail, released (it never became a marker)."""
        self.held = 0
        return self._jail.flush()


class BracketScanner:
    """Where a bracketed value ends, fed in pieces: ``{...}``, ``[...]`` (JSON), or a
    Python list of calls (``quotes="\\"'"``, parentheses count as brackets too).

    The first character fed must be the opening bracket. Brackets inside strings (either
    quote in ``quotes``, with backslash escapes, also across pieces) do not count.
    Mismatched brackets are not diagnosed: whoever parses the value finds them.
    """

    __slots__ = ("_depth", "_escaped", "_quote", "_quotes")

    def __init__(self, quotes: str = '"') -> None:
        self._quotes = quotes
        self._depth = 0
        self._quote = ""  # the quote of the string we are in ("" when outside)
        self._escaped = False  # the last piece ended with a backslash inside a string

    def end(self, text: str, start: int = 0) -> int:
        """Feed ``text[start:]``: the index just past the bracket that closes the value,
        or -1 when it is still open."""
        depth, quote = self._depth, self._quote
        skip = -1  # the position of an escaped character (inside a string)
        if self._escaped and start < len(text):
            skip, self._escaped = start, False
        for match in _SPECIAL.finditer(text, start):
            i = match.start()
            char = text[i]
            if quote:
                if i == skip:
                    continue
                if char == "\\":
                    if i + 1 < len(text):
                        skip = i + 1
                    else:
                        self._escaped = True
                elif char == quote:
                    quote = ""
            elif char in _OPENERS:
                depth += 1
            elif char in _CLOSERS:
                depth -= 1
                if depth <= 0:
                    self._depth, self._quote = 0, ""
                    return i + 1
            elif char in self._quotes:
                quote = char
        self._depth, self._quote = depth, quote
        return -1
