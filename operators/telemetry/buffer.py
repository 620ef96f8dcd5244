"""The last requests a process served, each with the spans of its stages: the status page's
per-stage timing bars, kept in process with no extra installed.

A request's spans end before the request's own (a stage's stream is closed before the
response ends), so the buffer collects spans per request until its first span ends, then
files the request away: at most ``size`` of them, the oldest dropped first. Nothing here
runs per token, and a request costs a list append per span.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, final

if TYPE_CHECKING:
    from pipeline.tracing import Span

__all__ = ("RecentRequest", "SpanBuffer")

#: requests whose spans are still being collected, at most (a safety bound: every request's
#: first span ends, in a ``finally``)
_MAX_OPEN: Final = 4096


@dataclass(frozen=True, slots=True)
class RecentRequest:
    """One finished request: its first span here and every span under it, in end order."""

    root: Span
    spans: tuple[Span, ...]

    def as_dict(self) -> dict[str, Any]:
        """The request as the status page shows it: its summary and a waterfall of spans
        (milliseconds from the request's start), parents before their children."""
        root = self.root
        attributes = root.attributes
        start = root.start_ns
        by_parent: dict[int | None, list[Span]] = {}
        for span in self.spans:
            by_parent.setdefault(span.parent_id, []).append(span)
        ordered: list[tuple[Span, int]] = []

        def visit(span: Span, depth: int) -> None:
            ordered.append((span, depth))
            for child in sorted(by_parent.get(span.span_id, ()), key=lambda s: s.start_ns):
                visit(child, depth + 1)

        visit(root, 0)
        ttft = attributes.get("gen_ai.response.time_to_first_chunk")
        return {
            "request_id": attributes.get("llm_pipeline.request.id"),
            "trace_id": f"{root.trace_id:032x}",
            "name": root.name,
            "status": attributes.get("http.response.status_code"),
            "model": attributes.get("gen_ai.request.model"),
            "prompt_tokens": attributes.get("gen_ai.usage.input_tokens"),
            "completion_tokens": attributes.get("gen_ai.usage.output_tokens"),
            "finish_reasons": attributes.get("gen_ai.response.finish_reasons"),
            "ttft_ms": None if not isinstance(ttft, float) else round(ttft * 1e3, 3),
            "duration_ms": round((root.end_ns - start) / 1e6, 3),
            "started_at_ms": start // 1_000_000,
            "error": root.error,
            "spans": [
                {
                    "name": span.name,
                    "depth": depth,
                    "start_ms": round((span.start_ns - start) / 1e6, 3),
                    "duration_ms": round(((span.end_ns or span.start_ns) - span.start_ns) / 1e6, 3),
                    "error": span.error,
                    "operator": span.attributes.get("llm_pipeline.operator"),
                    "worker": span.attributes.get("llm_pipeline.worker.id"),
                    "events": [
                        {"name": event.name, "at_ms": round((event.time_ns - start) / 1e6, 3)}
                        for event in span.events
                    ],
                }
                for span, depth in ordered
            ],
        }


@final
class SpanBuffer:
    """A :class:`~pipeline.tracing.SpanSink` keeping the last ``size`` requests."""

    __slots__ = ("_open", "_recent")

    def __init__(self, size: int = 50) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._open: dict[Span, list[Span]] = {}
        self._recent: deque[RecentRequest] = deque(maxlen=size)

    def on_end(self, span: Span, /) -> None:
        """File ``span`` under its request; the request's own span closes the record."""
        root = span.root
        if root is not span:
            spans = self._open.get(root)
            if spans is None:
                if root.ended:
                    return  # ended after its request (a leg left running): not shown
                if len(self._open) >= _MAX_OPEN:
                    del self._open[next(iter(self._open))]
                spans = self._open[root] = []
            spans.append(span)
            return
        spans = self._open.pop(span, [])
        self._recent.append(RecentRequest(span, (*spans, span)))

    def recent(self) -> list[RecentRequest]:
        """The requests kept, newest first."""
        return list(reversed(self._recent))

    def __len__(self) -> int:
        return len(self._recent)

    def __repr__(self) -> str:
        return f"SpanBuffer({len(self._recent)}/{self._recent.maxlen} requests)"
