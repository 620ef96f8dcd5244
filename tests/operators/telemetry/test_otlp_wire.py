"""The OTLP/HTTP exporter: its protobuf, decoded with ``opentelemetry-proto`` as a collector
does, and its transport (OpenTelemetry's variables, a collector that is down)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from operators.telemetry.otlp import OtlpExporter, otlp_environment
from operators.telemetry.otlp_wire import encode_request
from pipeline.tracing import Span, Tracer
from tests.operators.telemetry.otlp_receiver import OtlpReceiver, _value

attribute_values = st.one_of(
    st.text(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.lists(st.text(), max_size=4),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4),
)


def decode(data: bytes) -> Any:
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return request


@given(st.dictionaries(st.text(min_size=1), attribute_values, max_size=6), st.text())
def test_attributes_events_and_status_decode_as_written(
    attributes: dict[str, Any], name: str
) -> None:
    tracer = Tracer()
    root = tracer.start(
        name or "x", traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    )
    child = root.child("child", kind="client")
    for key, value in attributes.items():
        child.set(key, value)
    child.add_event("moment", attributes)
    child.set_error("it failed: ünïcode")
    child.end()
    root.end()
    request = decode(encode_request([child, root], {"service.name": "svc", "n": 3}))
    (resource_spans,) = request.resource_spans
    resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
    assert resource == {"service.name": "svc", "n": 3}
    (scope,) = resource_spans.scope_spans
    assert scope.scope.name == "llm-pipeline"
    got_child, got_root = scope.spans
    assert got_child.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
    assert got_child.span_id == child.span_id.to_bytes(8, "big")
    assert got_child.parent_span_id == root.span_id.to_bytes(8, "big")
    assert got_root.parent_span_id.hex() == "b7ad6b7169203331"  # the caller's
    assert got_root.name == (name or "x")
    assert got_child.kind == 3  # CLIENT
    assert got_root.kind == 2  # SERVER
    assert (got_child.start_time_unix_nano, got_child.end_time_unix_nano) == (
        child.start_ns,
        child.end_ns,
    )
    assert {kv.key: _value(kv.value) for kv in got_child.attributes} == attributes
    (event,) = got_child.events
    assert event.name == "moment"
    assert event.time_unix_nano == child.events[0].time_ns
    assert {kv.key: _value(kv.value) for kv in event.attributes} == attributes
    assert got_child.status.code == 2
    assert got_child.status.message == "it failed: ünïcode"
    assert got_root.status.code == 0
    # the parent's locality: local for the child, remote for the request's first span
    assert got_child.flags & 0x300 == 0x100
    assert got_root.flags & 0x300 == 0x300


def test_a_trace_without_a_parent_has_no_parent_span_id() -> None:
    span = Tracer().start("alone")
    span.end()
    (got,) = decode(encode_request([span], {})).resource_spans[0].scope_spans[0].spans
    assert got.parent_span_id == b""
    assert got.flags == 0


def test_opentelemetrys_variables_reach_the_collector() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=secret%20one,ignored",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,service.name=overridden",
    }
    headers, compress, timeout, certificate, resource = otlp_environment(environ)
    assert headers == {"x-api-key": "secret one"}
    assert compress
    assert timeout == 2.5
    assert certificate is None
    assert resource == {"deployment.environment": "test", "service.name": "overridden"}
    with OtlpReceiver() as receiver:
        exporter = OtlpExporter(receiver.endpoint, service_name="mine", environ=environ)
        tracer = Tracer(exporter)
        tracer.start("a").end()
        assert exporter.force_flush()
        exporter.shutdown()
        (span,) = receiver.spans
    assert span.service == "mine"  # the process's own name wins over the variable's
    (sent,) = receiver.headers
    assert sent["x-api-key"] == "secret one"
    assert sent["content-encoding"] == "gzip"
    assert sent["content-type"] == "application/x-protobuf"


def test_a_collector_that_is_down_loses_spans_quietly_and_is_found_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with OtlpReceiver() as receiver:
        endpoint = receiver.endpoint
    exporter = OtlpExporter(endpoint)  # nobody listens there any more
    tracer = Tracer(exporter)
    with caplog.at_level(logging.WARNING, logger="operators.telemetry.otlp"):
        for _ in range(3):
            tracer.start("lost").end()
            assert exporter.force_flush()
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1  # logged once, not per batch
    assert exporter.exported == 0
    exporter.shutdown()


def test_unsampled_spans_are_not_exported() -> None:
    with OtlpReceiver() as receiver:
        exporter = OtlpExporter(receiver.endpoint)
        tracer = Tracer(exporter)
        tracer.start(
            "no", traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
        ).end()
        tracer.start("yes").end()
        exporter.shutdown()
        assert [span.name for span in receiver.spans] == ["yes"]


def test_a_collectors_address_alone_gets_the_traces_path() -> None:
    with OtlpReceiver() as receiver:
        exporter = OtlpExporter(receiver.endpoint.removesuffix("/v1/traces"))
        Tracer(exporter).start("a").end()
        exporter.shutdown()
        assert [span.name for span in receiver.spans] == ["a"]


def test_a_bad_endpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        OtlpExporter("localhost:4318")


def test_spans_of_many_requests_go_in_batches() -> None:
    with OtlpReceiver() as receiver:
        exporter = OtlpExporter(receiver.endpoint, interval=60)
        tracer = Tracer(exporter)
        spans: list[Span] = []
        for index in range(1100):
            span = tracer.start(f"s{index}")
            span.end()
            spans.append(span)
        assert exporter.force_flush()
        exporter.shutdown()
        assert len(receiver.spans) == 1100
        assert receiver.requests >= 3  # at most 512 spans per request
    assert exporter.exported == 1100
