"""OTLP's protobuf wire format for traces, written directly: an ``ExportTraceServiceRequest``.

Why not OpenTelemetry's SDK encoder: measured on this project's spans (ten per request),
converting to the SDK's ``ReadableSpan`` and encoding took 350-550 µs of CPU per request,
about 1.5-2 µs per token of a 256-token answer, over the tracing budget (1 µs per token)
on its own; the generated ``opentelemetry-proto`` messages took ~175 µs. Writing the few
messages a trace needs by hand takes ~70 µs per request (``benchmarks/bench_tracing.py``),
~55 since the attributes a request shares with the ones before it (its stages' names, the
route, the model, the status) are written once and kept (``_written``).
The tests decode what this writes with ``opentelemetry-proto``, as a collector does.

Only what spans carry is written (``opentelemetry/proto/trace/v1/trace.proto``)::

    ExportTraceServiceRequest { repeated ResourceSpans resource_spans = 1; }
    ResourceSpans  { Resource resource = 1; repeated ScopeSpans scope_spans = 2; }
    Resource       { repeated KeyValue attributes = 1; }
    ScopeSpans     { InstrumentationScope scope = 1; repeated Span spans = 2; }
    InstrumentationScope { string name = 1; string version = 2; }
    Span  { bytes trace_id = 1; bytes span_id = 2; bytes parent_span_id = 4; string name = 5;
            SpanKind kind = 6; fixed64 start_time_unix_nano = 7; fixed64 end_time_unix_nano = 8;
            repeated KeyValue attributes = 9; repeated Event events = 11; Status status = 15;
            fixed32 flags = 16; }
    Event { fixed64 time_unix_nano = 1; string name = 2; repeated KeyValue attributes = 3; }
    Status { string message = 2; StatusCode code = 3; }
    KeyValue { string key = 1; AnyValue value = 2; }
    AnyValue { string string_value = 1; bool bool_value = 2; int64 int_value = 3;
               double double_value = 4; ArrayValue array_value = 5; }
    ArrayValue { repeated AnyValue values = 1; }
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from pipeline.tracing import AttributeValue, Span

__all__ = ("encode_request", "encode_span")

_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack
_pack_double = struct.Struct("<d").pack

#: SpanKind: INTERNAL 1, SERVER 2, CLIENT 3 (field 6, varint)
_KINDS: Final = {"internal": b"\x30\x01", "server": b"\x30\x02", "client": b"\x30\x03"}
#: Status { code = 2 (ERROR) }: field 3, varint
_STATUS_ERROR: Final = b"\x18\x02"
#: Span.flags (field 16, fixed32): bit 8 "has is_remote", bit 9 "is_remote" (the parent's)
_FLAGS_TAG: Final = b"\x85\x01"
_PARENT_LOCAL: Final = _pack_fixed32(0x100)
_PARENT_REMOTE: Final = _pack_fixed32(0x300)

#: attributes already written: (tag, key, type, value) -> the tagged KeyValue (the type
#: because True == 1). Most of a request's attributes (its stages' names, route, model,
#: status) are those of the request before; unique ones (ids, counts) fill it, so it is
#: emptied when full
_written: dict[tuple[bytes, str, type, AttributeValue], bytes] = {}
#: at most this many in ``_written``
_MAX_WRITTEN: Final = 4096
#: the types of value whose KeyValue is kept (floats are rarely repeated, lists unhashable)
_KEPT: Final = frozenset((str, int, bool))


def _varint(value: int) -> bytes:
    if value < 0:  # int64: two's complement over ten bytes
        value += 1 << 64
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _string(tag: bytes, text: str) -> bytes:
    return _delimited(tag, text.encode())


def _value(value: AttributeValue) -> bytes:
    """An ``AnyValue`` (a sequence becomes an ``ArrayValue``)."""
    if isinstance(value, str):
        return _string(b"\x0a", value)
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    items = b"".join(_delimited(b"\x0a", _value(item)) for item in value)
    return _delimited(b"\x2a", items)


def _attributes(tag: bytes, attributes: Mapping[str, AttributeValue]) -> bytes:
    parts = []
    written = _written
    kept = _KEPT
    for key, value in attributes.items():
        kind = type(value)
        if kind not in kept:  # a float, a sequence: written each time
            parts.append(_key_value(tag, key, value))
            continue
        item = (tag, key, kind, value)
        data = written.get(item)
        if data is None:
            if len(written) >= _MAX_WRITTEN:
                written.clear()
            data = written[item] = _key_value(tag, key, value)
        parts.append(data)
    return b"".join(parts)


def _key_value(tag: bytes, key: str, value: AttributeValue) -> bytes:
    return _delimited(tag, _string(b"\x0a", key) + _delimited(b"\x12", _value(value)))


def encode_span(span: Span) -> bytes:
    """``span`` as a ``Span`` message (its fields, without the enclosing tag)."""
    parts = [
        b"\x0a\x10",
        span.trace_id.to_bytes(16, "big"),
        b"\x12\x08",
        span.span_id.to_bytes(8, "big"),
    ]
    if span.parent_id is not None:
        parts += (b"\x22\x08", span.parent_id.to_bytes(8, "big"))
    parts += (
        _string(b"\x2a", span.name),
        _KINDS[span.kind],
        b"\x39",
        _pack_fixed64(span.start_ns),
        b"\x41",
        _pack_fixed64(span.end_ns),
    )
    if span.attributes:
        parts.append(_attributes(b"\x4a", span.attributes))
    for name, time_ns, attributes in span.events:
        event = b"\x09" + _pack_fixed64(time_ns) + _string(b"\x12", name)
        if attributes:
            event += _attributes(b"\x1a", attributes)
        parts.append(_delimited(b"\x5a", event))
    if span.error is not None:
        parts.append(_delimited(b"\x7a", _string(b"\x12", span.error) + _STATUS_ERROR))
    if span.parent_id is not None:  # a request's first span here has a remote parent
        parts += (_FLAGS_TAG, _PARENT_REMOTE if span.root is span else _PARENT_LOCAL)
    return b"".join(parts)


def encode_request(
    spans: Iterable[Span],
    resource: Mapping[str, AttributeValue],
    *,
    scope: str = "llm-pipeline",
    version: str = "",
) -> bytes:
    """One ``ExportTraceServiceRequest`` of ``spans``, all of one ``resource`` (its
    attributes: ``service.name``...) and one instrumentation scope."""
    scope_message = _string(b"\x0a", scope) + (_string(b"\x12", version) if version else b"")
    body = b"".join(_delimited(b"\x12", encode_span(span)) for span in spans)
    scope_spans = _delimited(b"\x0a", scope_message) + body
    resource_spans = _delimited(b"\x0a", _attributes(b"\x0a", resource)) + _delimited(
        b"\x12", scope_spans
    )
    return _delimited(b"\x0a", resource_spans)
