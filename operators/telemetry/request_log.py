"""``--log-format json``: one JSON line per request, and every other log record as JSON too.

A log shipper reads one object per line. The request line is written when the request's
span at the HTTP edge ends (a :class:`~pipeline.tracing.SpanSink`), so it has what the
span has: the request id and the trace id (to find the request's trace), the model, the
HTTP status, the token counts, the time to first token and the duration::

    {"time": "2026-01-02T03:04:05.678Z", "level": "info", "logger": "llm_pipeline.requests",
     "message": "POST /v1/chat/completions 200", "request_id": "...", "trace_id": "...",
     "model": "echo", "key": "team-a", "status": 200, "tokens": 12, "prompt_tokens": 30,
     "completion_tokens": 12, "ttft_ms": 3.1, "duration_ms": 20.4, ...}

``tokens`` is the tokens generated (``completion_tokens``, as in usage); ``key`` the name
of the request's API key (never the key; null without keys); ``arrival`` and
``admission`` where the request's arrival and admission fall in the frontend's numbering
of admission events (the order the fair queue let requests in). Lines go where
the other log records go (stderr), at level info whatever ``--log-level`` says: asking
for a line per request is asking for them.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any, Final, final

import orjson

if TYPE_CHECKING:
    from pipeline.tracing import Span

__all__ = ("REQUEST_LOGGER", "JsonFormatter", "RequestLog", "request_fields")

#: the logger of the per-request lines
REQUEST_LOGGER: Final = "llm_pipeline.requests"
#: attributes of a LogRecord that are not extra fields
_RECORD_FIELDS: Final = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _iso(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@final
class JsonFormatter(logging.Formatter):
    """Formats a log record as one JSON object: ``time``, ``level``, ``logger``,
    ``message``, the record's extra fields, and ``exception`` (the traceback) if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(
            (key, value)
            for key, value in record.__dict__.items()
            if key not in _RECORD_FIELDS and not key.startswith("_")
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def request_fields(span: Span) -> dict[str, Any]:
    """What the request line says about the request whose edge span is ``span``."""
    attributes = span.attributes
    ttft = attributes.get("gen_ai.response.time_to_first_chunk")
    completion = attributes.get("gen_ai.usage.output_tokens")
    return {
        "request_id": attributes.get("llm_pipeline.request.id"),
        "trace_id": f"{span.trace_id:032x}",
        "span_id": f"{span.span_id:016x}",
        "method": attributes.get("http.request.method"),
        "path": attributes.get("url.path"),
        "model": attributes.get("gen_ai.request.model"),
        "key": attributes.get("llm_pipeline.request.key"),
        "status": attributes.get("http.response.status_code"),
        "tokens": completion,
        "prompt_tokens": attributes.get("gen_ai.usage.input_tokens"),
        "completion_tokens": completion,
        "cached_tokens": attributes.get("gen_ai.usage.cache_read.input_tokens"),
        "finish_reasons": attributes.get("gen_ai.response.finish_reasons"),
        "ttft_ms": round(ttft * 1e3, 3) if isinstance(ttft, float) else None,
        "duration_ms": round((span.end_ns - span.start_ns) / 1e6, 3),
        "arrival": attributes.get("llm_pipeline.admission.arrival"),
        "admission": attributes.get("llm_pipeline.admission.order"),
        "error": span.error,
    }


@final
class RequestLog:
    """A :class:`~pipeline.tracing.SpanSink` writing one log line per HTTP request (the
    edge's span: its ``http.route``) to the :data:`REQUEST_LOGGER` logger, at info."""

    __slots__ = ("_logger",)

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger if logger is not None else logging.getLogger(REQUEST_LOGGER)
        if self._logger.level == logging.NOTSET or self._logger.level > logging.INFO:
            self._logger.setLevel(logging.INFO)

    def on_end(self, span: Span, /) -> None:
        """Log the request whose edge span ended (other spans are ignored)."""
        if span.root is not span or "http.route" not in span.attributes:
            return
        fields = request_fields(span)
        self._logger.info(
            "%s %s %s",
            fields["method"],
            fields["path"],
            fields["status"],
            extra=fields,
        )

    def __repr__(self) -> str:
        return f"RequestLog({self._logger.name!r})"
