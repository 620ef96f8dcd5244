"""Spans: what each stage of a graph did for one request, and for how long.

A traced request carries a :class:`Span` in its Context (``ctx.span``); without one
(the default) nothing here runs at all. The edge that receives a request starts its
trace with :meth:`Tracer.start`, honouring a W3C ``traceparent`` it was given, and puts
the span into the request's Context. From there :func:`pipeline.link` does the rest: each
linked operator gets a child span named after its class (or its stage name, see
:func:`pipeline.named`) and sees it as ``ctx.span`` in its own ``generate``; the engine
at the bottom gets one named ``"engine"``, with a ``first_token`` event. An operator
annotates its own span (``ctx.span.set(...)``, ``add_event``) or opens children for
work of its own (Migration's attempts, a router's prefill leg). A span ends when its
stream is closed, and a ended span goes to the tracer's sinks: an in-process buffer, an
OTLP exporter (``operators.telemetry``), a log line per request.

Why spans of our own rather than OpenTelemetry's API on the hot path: tracing must cost
nothing when it is off (no import, no per-request object, no per-token check) and little
when it is on; a span here is a slots object and two clock reads, never touched per token,
and the exporter converts finished spans in a background thread. Ids, timestamps and the
``traceparent`` format are OpenTelemetry's, so an exported trace joins any other.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Mapping, Sequence
from typing import Final, Literal, NamedTuple, Protocol, TypeAlias, final

__all__ = (
    "AttributeValue",
    "Span",
    "SpanEvent",
    "SpanKind",
    "SpanSink",
    "Tracer",
    "format_traceparent",
    "parse_traceparent",
)

AttributeValue: TypeAlias = str | bool | int | float | Sequence[str] | Sequence[int]
"""What an attribute may hold (OpenTelemetry's primitive values and their sequences)."""

SpanKind: TypeAlias = Literal["internal", "server", "client"]
"""OpenTelemetry's span kinds used here: ``server`` for a request received (the HTTP
edge, a worker serving a request from NATS), ``client`` for one sent elsewhere."""

logger = logging.getLogger(__name__)

_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_SAMPLED: Final = 0x01


def parse_traceparent(header: str | None) -> tuple[int, int, bool] | None:
    """``(trace id, parent span id, sampled)`` of a W3C ``traceparent`` header, or None
    when it is absent or malformed (a trace then starts fresh, as the spec says).

    Version ``00`` must be exactly four fields; a later version may append fields, and
    version ``ff`` or all-zero ids are invalid.
    """
    if not header:
        return None
    value = header.strip().lower()
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace, parent, flags = match.groups()
    if version == "ff" or (version == "00" and len(value) != 55):
        return None
    if len(value) > 55 and value[55] != "-":
        return None
    trace_id, span_id = int(trace, 16), int(parent, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & _SAMPLED)


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    """The W3C ``traceparent`` header naming span ``span_id`` of trace ``trace_id``."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class SpanSink(Protocol):
    """Where finished spans go: called once per span, on the event loop's thread (or the
    thread that ended it). Be quick; an exporter hands spans to its own thread."""

    def on_end(self, span: Span, /) -> None:
        """``span`` has ended."""


class SpanEvent(NamedTuple):
    """A point in time on a span."""

    #: what happened
    name: str
    #: when, in nanoseconds since the epoch
    time_ns: int
    #: what is known about it
    attributes: Mapping[str, AttributeValue]


_NO_ATTRIBUTES: Final[Mapping[str, AttributeValue]] = {}


@final
class Span:
    """One timed piece of a request's work: a stage, an attempt, a leg, an engine call.

    Made by :meth:`Tracer.start` (a request's first span here) or :meth:`child`. Its
    times are nanoseconds since the epoch (``time.time_ns()``), as OpenTelemetry's.
    A span is ended once; what is set on it after that is not exported.
    """

    __slots__ = (
        "_root",
        "_tracer",
        "attributes",
        "end_ns",
        "error",
        "events",
        "kind",
        "name",
        "parent_id",
        "sampled",
        "span_id",
        "start_ns",
        "trace_id",
    )

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        *,
        trace_id: int,
        parent_id: int | None,
        sampled: bool,
        kind: SpanKind = "internal",
        root: Span | None = None,
        start_ns: int | None = None,
    ) -> None:
        self._tracer = tracer
        #: what the span is of (a stage's name, ``"engine"``, ``"POST /v1/chat/completions"``)
        self.name = name
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64) or 1
        #: the parent's span id; None for a trace's first span (one from a ``traceparent``
        #: has its remote parent's)
        self.parent_id = parent_id
        #: False when the caller's ``traceparent`` said not to record (exporters skip it)
        self.sampled = sampled
        self.kind: SpanKind = kind
        self._root = root
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        #: 0 until the span ends
        self.end_ns = 0
        self.attributes: dict[str, AttributeValue] = {}
        self.events: list[SpanEvent] = []
        #: why the span failed (its status is an error), or None
        self.error: str | None = None

    # ------------------------------------------------------------------------ identity

    @property
    def traceparent(self) -> str:
        """This span as a W3C ``traceparent`` header: what a request sent on carries so
        that the receiver's spans hang under this one."""
        return format_traceparent(self.trace_id, self.span_id, self.sampled)

    @property
    def root(self) -> Span:
        """The first span of this request in this process (itself for that one). Not
        stored as a self-reference: that would make every request's first span a
        reference cycle, freed only by the garbage collector."""
        return self if self._root is None else self._root

    @property
    def ended(self) -> bool:
        """True once :meth:`end` was called."""
        return self.end_ns != 0

    @property
    def duration(self) -> float:
        """Seconds from start to end (to now while it runs)."""
        end = self.end_ns or time.time_ns()
        return (end - self.start_ns) / 1e9

    # ------------------------------------------------------------------------ building

    def child(
        self,
        name: str,
        *,
        kind: SpanKind = "internal",
        start_ns: int | None = None,
    ) -> Span:
        """A new span under this one, started now (or at ``start_ns``)."""
        return Span(
            self._tracer,
            name,
            trace_id=self.trace_id,
            parent_id=self.span_id,
            sampled=self.sampled,
            kind=kind,
            root=self.root,
            start_ns=start_ns,
        )

    def set(self, key: str, value: AttributeValue) -> None:
        """Set attribute ``key`` (OpenTelemetry's semantic-convention names where one
        exists, e.g. ``gen_ai.usage.output_tokens``; ``llm_pipeline.*`` otherwise)."""
        self.attributes[key] = value

    def add_event(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue] | None = None,
        *,
        time_ns: int | None = None,
    ) -> None:
        """Mark a point in time on this span (now, or at ``time_ns``)."""
        self.events.append(
            SpanEvent(
                name, time.time_ns() if time_ns is None else time_ns, attributes or _NO_ATTRIBUTES
            )
        )

    def set_error(self, description: str) -> None:
        """Mark the span failed, saying why (the first reason given is kept)."""
        if self.error is None:
            self.error = description or "error"

    def end(self, end_ns: int | None = None) -> None:
        """End the span now (or at ``end_ns``) and hand it to the tracer's sinks; a second
        call does nothing."""
        if self.end_ns:
            return
        self.end_ns = time.time_ns() if end_ns is None else max(end_ns, self.start_ns)
        self._tracer.finished(self)

    def __repr__(self) -> str:
        state = f"{self.duration * 1e3:.3f} ms" if self.end_ns else "running"
        return f"Span({self.name!r}, {self.trace_id:032x}/{self.span_id:016x}, {state})"


@final
class Tracer:
    """Starts a request's trace and hands every finished span to its ``sinks``.

    One per process (or per app); the sinks decide what tracing means: an in-process
    buffer for a status page, an OTLP exporter, a per-request log line. ``stages=False``
    records only the first span of each request (what a per-request log line needs): the
    edge then does not put it into the request's Context, so the graph runs untraced.
    """

    __slots__ = ("_sinks", "stages")

    def __init__(self, *sinks: SpanSink, stages: bool = True) -> None:
        self._sinks: tuple[SpanSink, ...] = sinks
        #: whether the graph's stages get spans (else only the request's first span)
        self.stages = stages

    @property
    def sinks(self) -> tuple[SpanSink, ...]:
        """Where finished spans go."""
        return self._sinks

    def add_sink(self, sink: SpanSink) -> None:
        """Send finished spans to ``sink`` too."""
        self._sinks = (*self._sinks, sink)

    def start(
        self,
        name: str,
        *,
        traceparent: str | None = None,
        kind: SpanKind = "server",
    ) -> Span:
        """The first span of a request in this process: a child of the caller's span when
        ``traceparent`` names one (a malformed header is ignored), else a new trace."""
        parent = parse_traceparent(traceparent)
        if parent is None:
            trace_id = random.getrandbits(128) or 1
            return Span(self, name, trace_id=trace_id, parent_id=None, sampled=True, kind=kind)
        trace_id, parent_id, sampled = parent
        return Span(self, name, trace_id=trace_id, parent_id=parent_id, sampled=sampled, kind=kind)

    def finished(self, span: Span) -> None:
        """Hand ``span`` to every sink (called by :meth:`Span.end`); a failing sink is
        not the request's problem, and must not stop the others."""
        for sink in self._sinks:
            try:
                sink.on_end(span)
            except Exception:  # one try per sink: a failing sink must not stop the others
                logger.exception("span sink %r failed", sink)

    def __repr__(self) -> str:
        return f"Tracer({', '.join(map(repr, self._sinks))}, stages={self.stages})"
