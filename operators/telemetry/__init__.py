"""What the server tells about itself besides its answers: spans kept for the status page,
spans exported over OTLP, and a JSON log line per request.

Each is a :class:`pipeline.tracing.SpanSink` on the process's
:class:`~pipeline.tracing.Tracer`, fed by the spans the HTTP edge, ``pipeline.link`` and
the operators record (see :mod:`pipeline.tracing`):

- :class:`~.buffer.SpanBuffer` keeps the last requests with their stages' spans, for the
  web UI's status view (no extra needed);
- :mod:`.otlp` exports them over OTLP/HTTP (protobuf, written by :mod:`.otlp_wire`),
  encoding and sending in a thread of its own, with the standard library only;
- :class:`~.request_log.RequestLog` writes one JSON line per request (``--log-format
  json``), with :class:`~.request_log.JsonFormatter` for every other log record.

:func:`~.setup.tracing_options` reads the command line and the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_SERVICE_NAME`` variables;
:func:`~.setup.make_tracer` builds the tracer they ask for, or None when nothing would
listen (then nothing is recorded at all). Nothing here imports an OpenTelemetry package.

Beside the spans, :mod:`.engine_metrics` holds the engines' Prometheus collectors
(``watch_batching(registry, counts)``...): the HTTP edge counts requests and knows no engine,
so what an engine reports about its batch, KV cache and drafts is registered from here, by
the entry point that loaded the engine.
"""

from __future__ import annotations

from .buffer import RecentRequest, SpanBuffer
from .request_log import JsonFormatter, RequestLog, request_fields
from .setup import TracingOptions, make_tracer, tracing_options

__all__ = (
    "JsonFormatter",
    "RecentRequest",
    "RequestLog",
    "SpanBuffer",
    "TracingOptions",
    "make_tracer",
    "request_fields",
    "tracing_options",
)
