"""The options that say what ``serve`` and ``worker`` tell about themselves: traces, the
log format, the web UI; and the logging set-up they imply.

::

    --otlp-traces-endpoint URL   export spans over OTLP/HTTP (protobuf); also
                                 OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SERVICE_NAME
    --log-format text|json       json: every log record as a JSON line, and (serve) one
                                 line per request
    --no-ui                      (serve) no web UI at / and no /status
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Final, Literal

from operators.telemetry import JsonFormatter
from operators.telemetry.setup import (
    OTEL_SERVICE_NAME_ENV,
    OTEL_TRACES_ENDPOINT_ENV,
    check_endpoint,
)

__all__ = (
    "LOG_FORMATS",
    "SERVICE_NAME",
    "WORKER_SERVICE_NAME",
    "LogFormat",
    "add_observability_options",
    "check_otel",
    "configure_logging",
)

#: the ``service.name`` of ``serve``'s spans, unless OTEL_SERVICE_NAME says otherwise
SERVICE_NAME: Final = "llm-pipeline"
#: the ``service.name`` of ``worker``'s spans, unless OTEL_SERVICE_NAME says otherwise
WORKER_SERVICE_NAME: Final = "llm-pipeline-worker"

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")
_TEXT_FORMAT: Final = "%(levelname)s %(name)s: %(message)s"


def add_observability_options(parser: argparse.ArgumentParser, *, ui: bool) -> None:
    """Add ``--otlp-traces-endpoint`` and ``--log-format`` (and, with ``ui``, ``--no-ui``)."""
    group = parser.add_argument_group(
        "observability",
        "Traces: a span per request at the HTTP edge, one per stage of the graph (named "
        "after the stage, or an inserted operator's class) and the engine call, with "
        "OpenTelemetry's HTTP and GenAI attributes; a W3C traceparent header is honoured. "
        "Over NATS the trace context travels with the request. Exported only to an OTLP "
        "endpoint; serve also keeps the last requests' spans in process for the web UI's "
        "status view (with --no-ui and no endpoint nothing is recorded at all).",
    )
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help=(
            "export spans over OTLP/HTTP (protobuf) to URL, e.g. "
            "http://127.0.0.1:4318/v1/traces (also "
            f"{OTEL_TRACES_ENDPOINT_ENV}; the service name is {OTEL_SERVICE_NAME_ENV}, "
            "else llm-pipeline / llm-pipeline-worker)"
        ),
    )
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help=(
            "json: each log record as one JSON object per line on stderr"
            + (
                ", and one line per request (request id, trace id, model, status, tokens, "
                "TTFT, duration)"
                if ui
                else ""
            )
        ),
    )
    if ui:
        group.add_argument(
            "--no-ui",
            dest="ui",
            action="store_false",
            help=(
                "do not serve the web UI (GET /: a chat playground and a status view) and "
                "its /status document; without the UI, spans are recorded only for an "
                "OTLP endpoint"
            ),
        )


def check_otel(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--otlp-traces-endpoint`` must be an http(s) URL (exits with code 2)."""
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if endpoint is not None:
        problem = check_endpoint(endpoint)
        if problem is not None:
            parser.error(f"--otlp-traces-endpoint: {problem}")


def configure_logging(level: str, log_format: LogFormat) -> None:
    """Log records at ``level`` and above to stderr, as text or one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level != "debug":
        # httpx logs every request at info: --engine remote's load polls would flood the
        # log (a few per second per upstream); its warnings and errors still show
        logging.getLogger("httpx").setLevel(logging.WARNING)
