"""Exporting spans over OTLP/HTTP (protobuf) with OpenTelemetry's own exporter.

Needs the ``[otel]`` extra (``opentelemetry-sdk``, ``opentelemetry-exporter-otlp-proto-http``):
this module imports them, and only the process that exports imports it.

:class:`OtlpExporter` is a :class:`~pipeline.tracing.SpanSink`. Its ``on_end``, on the event
loop, only appends the finished span to a queue; a thread of its own converts spans to
the SDK's ``ReadableSpan`` and sends them in batches (every :data:`EXPORT_INTERVAL`
seconds, or sooner once :data:`MAX_BATCH` are waiting), so the loop never encodes
protobuf or waits for the collector. Spans a ``traceparent`` marked as not sampled are
not exported. A collector that is down loses the spans of that moment (logged once),
never a request. :meth:`OtlpExporter.shutdown` sends what is left (the CLI calls it on
its way out).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Final, final

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pipeline.tracing import Span

__all__ = ("EXPORT_INTERVAL", "MAX_BATCH", "MAX_QUEUE", "OtlpExporter")

logger = logging.getLogger(__name__)

#: seconds between two exports (the most a span waits in the queue)
EXPORT_INTERVAL: Final = 1.0
#: spans per export request, at most; a full batch is sent without waiting
MAX_BATCH: Final = 512
#: spans waiting, at most: beyond, new ones are dropped (a collector far behind)
MAX_QUEUE: Final = 65536

_KINDS: Final = {
    "internal": SpanKind.INTERNAL,
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
}
_SAMPLED: Final = TraceFlags(TraceFlags.SAMPLED)
_SCOPE: Final = InstrumentationScope("llm-pipeline")


@final
class OtlpExporter:
    """Send finished spans to the OTLP/HTTP ``endpoint`` (a collector's ``/v1/traces``).

    ``service_name`` is the ``service.name`` resource attribute unless ``OTEL_SERVICE_NAME``
    says otherwise (``OTEL_RESOURCE_ATTRIBUTES`` is honoured too, as the SDK does);
    ``resource`` adds attributes (a worker's id). ``exporter`` replaces the OTLP/HTTP
    exporter (tests).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        service_name: str = "llm-pipeline",
        resource: Mapping[str, str] | None = None,
        exporter: SpanExporter | None = None,
        interval: float = EXPORT_INTERVAL,
    ) -> None:
        #: where spans go
        self.endpoint = endpoint
        attributes: dict[str, Any] = {"service.name": service_name, **(resource or {})}
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME over these.
        self._resource = Resource({"service.name": service_name}).merge(Resource.create(attributes))
        self._exporter = exporter if exporter is not None else OTLPSpanExporter(endpoint=endpoint)
        self._interval = interval
        self._queue: deque[Span] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._failing = False
        self._dropped = 0
        self._flushes: deque[threading.Event] = deque()
        self._thread = threading.Thread(target=self._run, name="otlp-exporter", daemon=True)
        self._thread.start()

    @property
    def service_name(self) -> str:
        """The ``service.name`` the spans are exported under."""
        return str(self._resource.attributes.get("service.name", ""))

    def on_end(self, span: Span, /) -> None:
        """Queue ``span`` for the exporting thread (a sampled one)."""
        if not span.sampled or self._closing:
            return
        queue = self._queue
        if len(queue) >= MAX_QUEUE:
            self._dropped += 1
            return
        queue.append(span)
        if len(queue) >= MAX_BATCH:
            self._wake.set()

    def force_flush(self, timeout: float = 10.0) -> None:
        """Export every queued span now (blocks this thread until done or ``timeout``)."""
        done = threading.Event()
        self._flushes.append(done)
        self._wake.set()
        done.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Export what is queued, then stop the thread and the exporter. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        self._exporter.shutdown()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            flushes = list(self._flushes)
            self._flushes.clear()
            self._export_queued()
            for done in flushes:
                done.set()
            if self._closing:
                self._export_queued()
                return

    def _export_queued(self) -> None:
        queue = self._queue
        while queue:
            batch = [queue.popleft() for _ in range(min(len(queue), MAX_BATCH))]
            try:
                result = self._exporter.export([self._convert(span) for span in batch])
            except Exception:
                result = SpanExportResult.FAILURE
                logger.debug("OTLP export raised", exc_info=True)
            self._report(result, len(batch))

    def _report(self, result: SpanExportResult, count: int) -> None:
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                logger.warning("OTLP export to %s works again", self.endpoint)
            self._failing = False
        elif not self._failing:
            self._failing = True
            logger.warning(
                "OTLP export to %s failed: %d spans lost (further failures are not logged)",
                self.endpoint,
                count,
            )
        if self._dropped:
            logger.warning("OTLP export queue full: %d spans dropped", self._dropped)
            self._dropped = 0

    def _convert(self, span: Span) -> ReadableSpan:
        trace_id = span.trace_id
        parent = None
        if span.parent_id is not None:
            remote = span.root is span  # a request's first span here: its parent is elsewhere
            parent = SpanContext(trace_id, span.parent_id, is_remote=remote, trace_flags=_SAMPLED)
        status = Status(StatusCode.UNSET)
        if span.error is not None:
            status = Status(StatusCode.ERROR, span.error)
        return ReadableSpan(
            name=span.name,
            context=SpanContext(trace_id, span.span_id, is_remote=False, trace_flags=_SAMPLED),
            parent=parent,
            resource=self._resource,
            attributes=dict(span.attributes),
            events=[
                Event(name, attributes=dict(attributes), timestamp=time_ns)
                for name, time_ns, attributes in span.events
            ],
            kind=_KINDS[span.kind],
            status=status,
            start_time=span.start_ns,
            end_time=span.end_ns,
            instrumentation_scope=_SCOPE,
        )

    def __repr__(self) -> str:
        return f"OtlpExporter({self.endpoint!r}, service={self.service_name!r})"
