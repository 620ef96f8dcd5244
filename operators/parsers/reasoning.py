"""Reasoning between markers: ``think`` (``<think>...</think>``) and its relatives.

Text between the start and end markers is reasoning (OpenAI-compatible servers'
``reasoning_content``); the rest is content, which a tool-call parser then reads. The
markers themselves are withheld exactly like partial stop strings and never shown. A
choice that ends inside a reasoning block releases the rest as reasoning (a model cut off
by ``max_tokens`` while thinking still shows what it thought).

``starts_in_reasoning`` is for templates that open the block in the prompt, so the model
writes only the end marker.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .base import Parsed
from .scan import MarkerScanner

__all__ = ("MarkerReasoningFormat", "MarkerReasoningParser")


@dataclass(frozen=True, slots=True)
class MarkerReasoningFormat:
    """Reasoning as ``start`` ... ``end`` blocks anywhere in the output."""

    start: str = "<think>"
    end: str = "</think>"
    name: str = "think"
    starts_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("a reasoning format needs non-empty start and end markers")

    def parser(self) -> MarkerReasoningParser:
        """A parser for one choice."""
        return MarkerReasoningParser(self)


class MarkerReasoningParser:
    """One choice's parser for a :class:`MarkerReasoningFormat`."""

    __slots__ = ("_content", "_fed", "_format", "_reasoning", "_runs", "_scanner", "held")

    def __init__(self, reasoning_format: MarkerReasoningFormat) -> None:
        self._format = reasoning_format
        self._reasoning = reasoning_format.starts_in_reasoning
        self._scanner = MarkerScanner(
            (reasoning_format.end if self._reasoning else reasoning_format.start,)
        )
        self._fed = 0  # raw characters fed
        self._content = 0  # content characters released
        #: (content offset, raw offset) where each run of content begins: content is
        #: contiguous in the raw text between reasoning blocks
        self._runs: deque[tuple[int, int]] = deque()
        if not self._reasoning:
            self._runs.append((0, 0))
        #: characters withheld: the tail that may still become a marker
        self.held = 0

    def feed(self, text: str, /) -> Parsed:
        """Take the next raw text; return the reasoning and content it releases."""
        self._fed += len(text)
        released, marker, text = self._scanner.scan(text)
        if marker is None:  # the common case: no block starts or ends here
            self.held = self._scanner.held
            if self._reasoning:
                return Parsed("", released)
            self._content += len(released)
            return Parsed(released)
        content: list[str] = []
        reasoning: list[str] = []
        while True:
            if self._reasoning:
                reasoning.append(released)
            else:
                content.append(released)
                self._content += len(released)
            if marker is None:
                break
            self._switch()
            if not self._reasoning:  # content resumes right after the end marker
                self._runs.append((self._content, self._fed - len(text)))
            released, marker, text = self._scanner.scan(text)
        self.held = self._scanner.held
        return Parsed("".join(content), "".join(reasoning))

    def finish(self) -> Parsed:
        """Release the withheld tail as what it would have been: reasoning inside a
        block, content outside."""
        rest = self._scanner.flush()
        self.held = 0
        if self._reasoning:
            return Parsed("", rest)
        self._content += len(rest)
        return Parsed(rest)

    def source_offset(self, content_offset: int, /) -> int:
        """The raw offset of content character ``content_offset`` (asked in order)."""
        runs = self._runs
        while len(runs) > 1 and runs[1][0] <= content_offset:
            runs.popleft()
        content, raw = runs[0]
        return raw + content_offset - content

    def _switch(self) -> None:
        self._reasoning = not self._reasoning
        fmt = self._format
        self._scanner = MarkerScanner((fmt.end if self._reasoning else fmt.start,))
