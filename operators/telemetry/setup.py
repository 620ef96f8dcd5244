"""Which tracing a process runs: from its command line and OpenTelemetry's variables.

The endpoint is ``--otlp-traces-endpoint``, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
(the whole URL, as the OpenTelemetry spec has it), else ``OTEL_EXPORTER_OTLP_ENDPOINT``
plus ``/v1/traces``. The service name is ``OTEL_SERVICE_NAME``, else the process's
default (``llm-pipeline`` for ``serve``, ``llm-pipeline-worker`` for ``worker``).

:func:`make_tracer` returns None when no sink would listen: the edge then starts no span
and the graph runs exactly as it does without tracing. The spans of the graph's stages are
recorded when a sink shows them (the status page's buffer, an OTLP exporter); a JSON log
alone needs only the request's own span.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from pipeline.tracing import SpanSink, Tracer

from .request_log import RequestLog

if TYPE_CHECKING:
    from .buffer import SpanBuffer
    from .otlp import OtlpExporter

__all__ = (
    "OTEL_ENDPOINT_ENV",
    "OTEL_SERVICE_NAME_ENV",
    "OTEL_TRACES_ENDPOINT_ENV",
    "TracingOptions",
    "check_endpoint",
    "make_tracer",
    "tracing_options",
)

logger = logging.getLogger(__name__)

OTEL_TRACES_ENDPOINT_ENV: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTEL_ENDPOINT_ENV: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_SERVICE_NAME_ENV: Final = "OTEL_SERVICE_NAME"


@dataclass(frozen=True, slots=True)
class TracingOptions:
    """Where spans are exported (None: nowhere), and as which service."""

    endpoint: str | None = None
    service_name: str = "llm-pipeline"
    #: True when the endpoint came from the command line (a missing extra is then an
    #: error, not a warning)
    from_flag: bool = False


def tracing_options(
    flag: str | None,
    *,
    service_name: str,
    environ: Mapping[str, str] | None = None,
) -> TracingOptions:
    """The options of a process started with ``--otlp-traces-endpoint flag`` (None: not
    given), read with OpenTelemetry's variables from ``environ`` (default: the process's)."""
    env = os.environ if environ is None else environ
    name = env.get(OTEL_SERVICE_NAME_ENV, "").strip() or service_name
    if flag:
        return TracingOptions(flag, name, from_flag=True)
    endpoint = env.get(OTEL_TRACES_ENDPOINT_ENV, "").strip()
    if not endpoint:
        base = env.get(OTEL_ENDPOINT_ENV, "").strip()
        if base:
            endpoint = base.rstrip("/") + "/v1/traces"
    return TracingOptions(endpoint or None, name)


def check_endpoint(endpoint: str) -> str | None:
    """What is wrong with ``endpoint`` as an OTLP/HTTP URL, or None."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{endpoint!r} is not an http(s) URL (e.g. http://127.0.0.1:4318/v1/traces)"
    return None


def make_tracer(
    options: TracingOptions,
    *,
    buffer: SpanBuffer | None = None,
    request_log: bool = False,
    resource: Mapping[str, str] | None = None,
) -> tuple[Tracer | None, OtlpExporter | None]:
    """The process's tracer and its exporter (to shut down on the way out): spans go to
    ``buffer``, to an OTLP exporter when ``options`` has an endpoint, and a JSON line per
    request when ``request_log``. (None, None) when none of them is wanted.

    An endpoint that is not an http(s) URL is a warning (from the environment; the command
    line refuses one before this runs) and exports nothing.
    """
    sinks: list[SpanSink] = []
    if buffer is not None:
        sinks.append(buffer)
    exporter = None
    if options.endpoint is not None:
        problem = check_endpoint(options.endpoint)
        if problem is not None:
            logger.warning("no traces are exported: the OTLP endpoint %s", problem)
        else:
            from .otlp import OtlpExporter

            exporter = OtlpExporter(
                options.endpoint, service_name=options.service_name, resource=resource
            )
            sinks.append(exporter)
    stages = bool(sinks)
    if request_log:
        sinks.append(RequestLog())
    if not sinks:
        return None, None
    return Tracer(*sinks, stages=stages), exporter
