"""Exporting spans over OTLP/HTTP (protobuf): :class:`OtlpExporter`.

A :class:`~pipeline.tracing.SpanSink` whose ``on_end``, on the event loop, only appends the
finished span to a queue. A thread of its own encodes spans (:mod:`.otlp_wire`) and posts
them in batches to the collector's ``/v1/traces`` (every :data:`EXPORT_INTERVAL` seconds,
or sooner once :data:`MAX_BATCH` are waiting), over one kept-alive HTTP connection, so the
loop never encodes or waits for the collector. It needs no package beyond the standard
library, and honours OpenTelemetry's exporter variables: ``OTEL_EXPORTER_OTLP_HEADERS``
and ``..._TRACES_HEADERS`` (``key=value,...``, e.g. a collector's API key),
``..._COMPRESSION`` (``gzip``), ``..._TIMEOUT`` (milliseconds, as the specification has
it; 10 s by default), ``..._CERTIFICATE`` (a CA file for https), and
``OTEL_RESOURCE_ATTRIBUTES``.

Spans that a ``traceparent`` marked as not sampled are not exported. A collector that is
down loses the spans of that moment (logged once until it works again), never a request.
:meth:`OtlpExporter.shutdown` sends what is left; the command line calls it on its way out.
"""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import ssl
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final, final

from .otlp_wire import encode_request

if TYPE_CHECKING:
    from pipeline.tracing import AttributeValue, Span

__all__ = ("EXPORT_INTERVAL", "MAX_BATCH", "MAX_QUEUE", "OtlpExporter", "otlp_environment")

logger = logging.getLogger(__name__)

#: seconds between two exports (the most a span waits in the queue)
EXPORT_INTERVAL: Final = 1.0
#: spans per export request, at most; a full batch is sent without waiting
MAX_BATCH: Final = 512
#: spans waiting, at most: beyond, new ones are dropped (a collector far behind)
MAX_QUEUE: Final = 65536
_DEFAULT_TIMEOUT: Final = 10.0


def _env(name: str, environ: Mapping[str, str]) -> str:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    return (
        environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
        or environ.get(f"OTEL_EXPORTER_OTLP_{name}")
        or ""
    ).strip()


def _pairs(text: str) -> dict[str, str]:
    """``key=value,key2=value2`` (values percent-decoded), as W3C baggage and OTel write it."""
    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            pairs[key.strip()] = urllib.parse.unquote(value.strip())
    return pairs


def otlp_environment(
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], bool, float, str | None, dict[str, str]]:
    """What OpenTelemetry's exporter variables ask for: (headers, gzip, timeout in seconds,
    CA file, resource attributes)."""
    env = os.environ if environ is None else environ
    headers = _pairs(_env("HEADERS", env))
    compress = _env("COMPRESSION", env).lower() == "gzip"
    timeout = _DEFAULT_TIMEOUT
    raw = _env("TIMEOUT", env)
    if raw:
        try:
            timeout = max(0.001, float(raw) / 1000)
        except ValueError:
            logger.warning("ignoring OTEL_EXPORTER_OTLP_TIMEOUT=%r (not milliseconds)", raw)
    certificate = _env("CERTIFICATE", env) or None
    resource = _pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    return headers, compress, timeout, certificate, resource


@final
class _Poster:
    """POSTs bodies to one URL over a kept-alive connection (reopened after an error)."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        *,
        compress: bool,
        timeout: float,
        certificate: str | None,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        # a bare collector address gets OTLP's traces path, as OTEL_EXPORTER_OTLP_ENDPOINT does
        path = parts.path if parts.path not in ("", "/") else "/v1/traces"
        self._path = path + (f"?{parts.query}" if parts.query else "")
        self._headers = {
            **headers,
            "Content-Type": "application/x-protobuf",
            "User-Agent": "llm-pipeline",
        }
        if compress:
            self._headers["Content-Encoding"] = "gzip"
        self._compress = compress
        self._timeout = timeout
        self._context = ssl.create_default_context(cafile=certificate) if self._https else None
        self._connection: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            if self._https:
                self._connection = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=self._context
                )
            else:
                self._connection = http.client.HTTPConnection(
                    self._host, self._port, timeout=self._timeout
                )
        return self._connection

    def post(self, body: bytes) -> int:
        """Send ``body``; the collector's HTTP status.

        Raises:
            OSError, http.client.HTTPException: the collector cannot be reached.
        """
        if self._compress:
            body = gzip.compress(body)
        for attempt in (1, 2):  # a kept-alive connection the collector closed: once more
            connection = self._connect()
            try:
                connection.request("POST", self._path, body, self._headers)
                response = connection.getresponse()
                response.read()
                return response.status
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


@final
class OtlpExporter:
    """Send finished spans to the OTLP/HTTP ``endpoint`` (a collector's ``/v1/traces``;
    an endpoint with no path, ``http://collector:4318``, gets that path).

    ``service_name`` is the ``service.name`` resource attribute; ``resource`` adds others
    (a worker's id); ``OTEL_RESOURCE_ATTRIBUTES`` adds more, without overriding these.
    ``environ`` replaces the process's environment (tests).

    Raises:
        ValueError: ``endpoint`` is not an http(s) URL.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        service_name: str = "llm-pipeline",
        resource: Mapping[str, str] | None = None,
        interval: float = EXPORT_INTERVAL,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        headers, compress, timeout, certificate, extra = otlp_environment(environ)
        #: where spans go
        self.endpoint = endpoint
        self._poster = _Poster(
            endpoint, headers, compress=compress, timeout=timeout, certificate=certificate
        )
        attributes: dict[str, AttributeValue] = {**extra}
        attributes.update(resource or {})
        attributes["service.name"] = service_name
        self._resource = attributes
        self._interval = interval
        self._queue: deque[Span] = deque()
        self._wake = threading.Event()
        self._flushes: deque[threading.Event] = deque()
        self._closing = False
        self._failing = False
        self._dropped = 0
        #: spans sent so far (accepted by the collector)
        self.exported = 0
        #: CPU seconds the exporting thread spent encoding and sending
        self.cpu_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="otlp-exporter", daemon=True)
        self._thread.start()

    @property
    def service_name(self) -> str:
        """The ``service.name`` the spans are exported under."""
        return str(self._resource["service.name"])

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

    def force_flush(self, timeout: float = 10.0) -> bool:
        """Export every span queued now; False when that took longer than ``timeout``."""
        if self._closing:
            return True
        done = threading.Event()
        self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Export what is queued, then stop the thread. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self._interval)
                self._wake.clear()
                flushes = list(self._flushes)
                self._flushes.clear()
                started = time.thread_time()
                self._export_queued()
                self.cpu_seconds += time.thread_time() - started
                for done in flushes:
                    done.set()
                if self._closing:
                    self._export_queued()
                    return
        finally:
            self._poster.close()
            for done in self._flushes:
                done.set()

    def _export_queued(self) -> None:
        queue = self._queue
        while queue:
            batch = [queue.popleft() for _ in range(min(len(queue), MAX_BATCH))]
            try:
                status = self._poster.post(encode_request(batch, self._resource))
                problem = None if 200 <= status < 300 else f"HTTP {status}"
            except Exception as exc:  # the collector is down, slow, unreachable
                problem = repr(exc)
            self._report(problem, len(batch))

    def _report(self, problem: str | None, count: int) -> None:
        if problem is None:
            self.exported += count
            if self._failing:
                logger.warning("OTLP export to %s works again", self.endpoint)
            self._failing = False
        elif not self._failing:
            self._failing = True
            logger.warning(
                "OTLP export to %s failed (%s): %d spans lost (until it works again, "
                "further losses are not logged)",
                self.endpoint,
                problem,
                count,
            )
        if self._dropped:
            logger.warning("OTLP export queue full: %d spans dropped", self._dropped)
            self._dropped = 0

    def __repr__(self) -> str:
        return f"OtlpExporter({self.endpoint!r}, service={self.service_name!r})"
