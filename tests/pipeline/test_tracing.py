"""Spans per request and stage (``pipeline.tracing``), given by ``link`` to every operator.

A traced request (its Context carries a span) gets one span per linked operator, named
after its class or its ``named`` name, and one ``engine`` span, parented stage by stage;
spans end when their streams are closed. An untraced request gets no span and no wrapper.
"""

from __future__ import annotations

import itertools
from contextlib import aclosing
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline import Context, Engine, EngineError, Stream, chain, link, named, open_stream
from pipeline.testing import ScriptedEngine, collect
from pipeline.tracing import Span, Tracer, format_traceparent, parse_traceparent
from tests.helpers.garbage import cyclic_garbage


class Recorder:
    """A span sink keeping every span it is handed, in end order."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def on_end(self, span: Span, /) -> None:
        self.spans.append(span)

    def by_name(self) -> dict[str, Span]:
        return {span.name: span for span in self.spans}

    def parent_of(self, span: Span) -> Span | None:
        return next((s for s in self.spans if s.span_id == span.parent_id), None)


class Upper:
    """Upper-cases each output (an async generator: a stage of its own)."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx):
            yield item.upper()


class Passthrough:
    """Hands downstream's stream back (no hop of its own)."""

    def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        return downstream.generate(ctx)


class SeesItsSpan:
    """Records what it sees as ``ctx.span`` and annotates it."""

    def __init__(self) -> None:
        self.seen: list[Span | None] = []

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        self.seen.append(ctx.span)
        if ctx.span is not None:
            ctx.span.set("custom", "yes")
            ctx.span.add_event("started")
        async for item in downstream.generate(ctx):
            yield item


def traced(data: str = "req") -> tuple[Context[str], Recorder, Span]:
    recorder = Recorder()
    root = Tracer(recorder).start("request")
    return Context.new(data, span=root), recorder, root


async def test_every_linked_operator_gets_a_span_parented_stage_by_stage() -> None:
    ctx, recorder, root = traced()
    graph = link(
        Upper(), named("middle", Passthrough()), chain(SeesItsSpan()), ScriptedEngine(["a", "b"])
    )
    assert await collect(graph, ctx) == ["A", "B"]
    root.end()
    spans = recorder.by_name()
    assert set(spans) == {"request", "Upper", "middle", "SeesItsSpan", "engine"}
    chain_of_parents = ["engine", "SeesItsSpan", "middle", "Upper", "request"]
    for child, parent in itertools.pairwise(chain_of_parents):
        assert recorder.parent_of(spans[child]) is spans[parent]
    assert {span.trace_id for span in recorder.spans} == {root.trace_id}
    assert spans["middle"].attributes["llm_pipeline.operator"] == "Passthrough"
    assert spans["engine"].attributes["llm_pipeline.operator"] == "ScriptedEngine"
    assert spans["SeesItsSpan"].attributes["custom"] == "yes"
    assert [event.name for event in spans["engine"].events] == ["first_token"]
    # Every span ended, inside its parent's time.
    for span in recorder.spans:
        parent = recorder.parent_of(span)
        assert span.ended
        if parent is not None:
            assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns


async def test_an_operator_sees_its_own_span_as_ctx_span() -> None:
    ctx, recorder, root = traced()
    probe = SeesItsSpan()
    await collect(link(Upper(), probe, ScriptedEngine(["x"])), ctx)
    root.end()
    (seen,) = probe.seen
    assert seen is recorder.by_name()["SeesItsSpan"]


async def test_an_untraced_request_gets_no_span_and_the_untraced_streams() -> None:
    probe = SeesItsSpan()
    graph = link(Upper(), Passthrough(), probe, ScriptedEngine(["a"]))
    ctx = Context.new("req")
    stream = graph.generate(ctx)
    # exactly what link returned before tracing existed: no span-keeping wrapper
    assert type(stream).__name__ == "_LinkedStream"
    async with aclosing(stream):
        assert [item async for item in stream] == ["A"]
    assert probe.seen == [None]
    passthrough = link(Passthrough(), ScriptedEngine(["a"]))
    inner = passthrough.generate(Context.new("req"))
    assert type(inner).__name__ == "async_generator"
    await inner.aclose()  # type: ignore[attr-defined]


async def test_spans_end_when_the_consumer_stops_early() -> None:
    ctx, recorder, root = traced()
    graph = link(Upper(), Passthrough(), ScriptedEngine(["a", "b", "c"]))
    async with open_stream(graph, ctx) as stream:
        async for _ in stream:
            break
    assert {span.name for span in recorder.spans} == {"Upper", "Passthrough", "engine"}
    assert all(span.ended for span in recorder.spans)
    assert not root.ended


async def test_an_engine_failing_before_its_first_output_marks_its_span() -> None:
    ctx, recorder, _root = traced()
    graph = link(Upper(), ScriptedEngine([], then=EngineError("no luck")))
    with pytest.raises(EngineError):
        await collect(graph, ctx)
    spans = recorder.by_name()
    assert spans["engine"].error is not None
    assert "no luck" in spans["engine"].error


async def test_each_retry_opens_new_spans_under_the_retrier() -> None:
    class Retry:
        """Calls downstream twice, each time under an attempt span of its own."""

        async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
            for number in (1, 2):
                assert ctx.span is not None
                attempt = ctx.span.child(f"attempt {number}")
                async with aclosing(downstream.generate(ctx.with_span(attempt))) as stream:
                    async for item in stream:
                        yield item
                attempt.end()

    ctx, recorder, _root = traced()
    await collect(link(Retry(), Upper(), ScriptedEngine(["a"])), ctx)
    uppers = [span for span in recorder.spans if span.name == "Upper"]
    attempts = {
        span.span_id: span.name for span in recorder.spans if span.name.startswith("attempt")
    }
    assert sorted(attempts[span.parent_id] for span in uppers) == ["attempt 1", "attempt 2"]


def test_named_refuses_an_empty_name_and_a_chain() -> None:
    from pipeline import LinkError

    with pytest.raises(LinkError, match="non-empty"):
        named("", Upper())
    with pytest.raises(LinkError, match="chain"):
        named("x", chain(Upper(), Upper()))


async def test_a_failing_sink_does_not_fail_the_request_nor_the_other_sinks() -> None:
    class Broken:
        def on_end(self, span: Span, /) -> None:
            raise RuntimeError("sink down")

    recorder = Recorder()
    root = Tracer(Broken(), recorder).start("request")
    assert await collect(link(Upper(), ScriptedEngine(["a"])), Context.new("r", span=root)) == ["A"]
    assert {span.name for span in recorder.spans} == {"Upper", "engine"}


def test_a_traceparent_is_joined_and_a_bad_one_starts_a_new_trace() -> None:
    tracer = Tracer()
    header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    span = tracer.start("x", traceparent=header)
    assert span.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert span.parent_id == 0x00F067AA0BA902B7
    assert span.sampled
    assert span.traceparent.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    for bad in (
        "",
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # 00 has 4 fields
    ):
        fresh = tracer.start("x", traceparent=bad)
        assert fresh.parent_id is None, bad
    later = parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more")
    assert later == (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, False)


@given(
    trace_id=st.integers(min_value=1, max_value=2**128 - 1),
    span_id=st.integers(min_value=1, max_value=2**64 - 1),
    sampled=st.booleans(),
)
def test_traceparent_round_trips(trace_id: int, span_id: int, sampled: bool) -> None:
    header = format_traceparent(trace_id, span_id, sampled)
    assert len(header) == 55
    assert parse_traceparent(header) == (trace_id, span_id, sampled)
    assert parse_traceparent(header.upper()) == (trace_id, span_id, sampled)


def test_a_span_ends_once_and_children_keep_the_trace() -> None:
    recorder = Recorder()
    root = Tracer(recorder).start("r")
    child = root.child("c")
    assert child.trace_id == root.trace_id
    assert child.parent_id == root.span_id
    assert child.root is root
    child.end()
    child.end()
    assert recorder.spans == [child]
    child.set_error("first")
    child.set_error("second")
    assert child.error == "first"


def _a_traced_request(tracer: Tracer) -> None:
    root = tracer.start("POST /v1/chat/completions")
    stage = root.child("Migration")
    engine = stage.child("engine")
    engine.add_event("first_token")
    assert root.root is root
    assert engine.root is root
    for span in (engine, stage, root):
        span.end()


def test_a_traced_request_leaves_no_reference_cycle() -> None:
    """A first span is its own root without pointing at itself: its spans are freed as
    soon as nothing holds them, not at the next collection (which a server runs rarely)."""
    recorder = Recorder()
    with cyclic_garbage() as found:
        _a_traced_request(Tracer(recorder))
        recorder.spans.clear()
    assert not found, found


def test_tracer_start_without_sinks_records_nothing_anywhere() -> None:
    tracer = Tracer(stages=False)
    span: Any = tracer.start("r")
    span.end()
    assert tracer.sinks == ()
    assert not tracer.stages
