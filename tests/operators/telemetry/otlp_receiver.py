"""A real OTLP/HTTP trace receiver for tests: an HTTP server decoding the protobuf bodies.

It listens on a free loopback port in a thread and accepts ``POST /v1/traces`` (OTLP's
``ExportTraceServiceRequest``, gzip-compressed or not), as a collector would, and keeps
every span it received as a :class:`ReceivedSpan`, decoded with ``opentelemetry-proto``.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ("OtlpReceiver", "ReceivedSpan")

_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return None if kind is None else getattr(value, kind)


@dataclass
class ReceivedSpan:
    """One span as a collector received it (ids as hex)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a trace's first span
    kind: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    status_message: str = ""

    @property
    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


class OtlpReceiver:
    """``with OtlpReceiver() as receiver:`` then export to ``receiver.endpoint``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.content_types: set[str] = set()
        #: the headers of every export request received
        self.headers: list[dict[str, str]] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = self.rfile.read(length)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                receiver._store(request, self.headers.get("content-type", ""))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1/traces"

    def _store(self, request: ExportTraceServiceRequest, content_type: str) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=_KINDS.get(span.kind, str(span.kind)),
                            service=service,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                            events=[
                                (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in span.events
                            ],
                            status_code=span.status.code,
                            status_message=span.status.message,
                        )
                    )
        with self._changed:
            self.requests += 1
            self.content_types.add(content_type)
            self.spans.extend(received)
            self._changed.notify_all()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 15.0
    ) -> list[ReceivedSpan]:
        """Wait until ``done(spans)`` holds; the spans received so far."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self.spans})
                    raise AssertionError(f"timed out waiting for spans; received {names}")
                self._changed.wait(left)
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [s for s in self.spans if s.trace_id == trace_id]

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
