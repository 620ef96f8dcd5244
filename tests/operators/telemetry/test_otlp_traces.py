"""OpenTelemetry traces received by a real OTLP/HTTP collector (``otlp_receiver``).

In process (``build_app(tracer=...)`` with the real exporter) and end to end (``serve
--otlp-traces-endpoint``, ``serve --nats`` with a ``worker``, both exporting), one chat
request is one trace: the edge's span, a span per stage of the default graph, and the
engine's, each under the one before; the GenAI attributes equal the response's usage; a
``traceparent`` header joins the caller's trace; a migrated request shows two attempts;
over NATS the worker's spans share the trace and hang under the frontend's engine span.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.telemetry import SpanBuffer, TracingOptions, make_tracer
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer
from pipeline.tracing import Tracer
from tests.helpers.server_process import ServerProcess
from tests.helpers.shout import Shout
from tests.operators.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

TOKENIZER = Tokenizer.default()
CHAT = "POST /v1/chat/completions"
#: the default graph's stages, front to back, as their spans are named
STAGES = ("preprocessor", "parser", "migration", "backend", "encoder_router", "prefill_router")
MESSAGES = [{"role": "system", "content": "echo"}, {"role": "user", "content": "Hello there"}]


@contextmanager
def exporting(**options: Any) -> Iterator[tuple[OtlpReceiver, Tracer]]:
    """A receiver, and a tracer exporting to it over OTLP/HTTP (shut down on exit)."""
    with OtlpReceiver() as receiver:
        tracer, exporter = make_tracer(TracingOptions(receiver.endpoint), **options)
        assert tracer is not None
        assert exporter is not None
        try:
            yield receiver, tracer
        finally:
            exporter.shutdown()


def one_trace(receiver: OtlpReceiver, edges: int = 1, timeout: float = 15) -> list[ReceivedSpan]:
    """The spans of the one trace received once ``edges`` edge spans arrived."""
    spans = receiver.wait_for(lambda s: sum(x.name == CHAT for x in s) >= edges, timeout)
    traces = {span.trace_id for span in spans}
    assert len(traces) == 1, f"{len(traces)} traces"
    return spans


def by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {span.span_id: span for span in spans}


def ancestry(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[str]:
    """The names from ``span`` up to its trace's first span received."""
    index = by_id(spans)
    names = [span.name]
    while span.parent_span_id in index:
        span = index[span.parent_span_id]
        names.append(span.name)
    return names


def only(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {[s.name for s in spans]}"
    return found[0]


def check_graph_trace(spans: list[ReceivedSpan], usage: dict[str, Any], finish: str) -> None:
    """The edge, each stage and the engine, each under the one before it, and the GenAI
    attributes equal to ``usage``."""
    edge = only(spans, CHAT)
    assert edge.kind == "server"
    engine = only(spans, "engine")
    chain = ancestry(engine, spans)
    assert chain[-1] == CHAT
    # front to back: the edge, the stages in order (Migration's attempt between migration
    # and the backend), then the engine (a ConstraintGuard may sit just above it)
    expected = [CHAT, "preprocessor", "parser", "migration", "attempt", "backend"]
    expected += ["encoder_router", "prefill_router"]
    got = list(reversed(chain))
    assert got[: len(expected)] == expected
    assert got[-1] == "engine"
    assert set(got[len(expected) : -1]) <= {"ConstraintGuard"}
    for stage in STAGES:
        only(spans, stage)
    attributes = edge.attributes
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.route"] == "/v1/chat/completions"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "echo"
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == [finish]
    assert "first_token" in edge.event_names
    assert "finish" in edge.event_names
    assert "first_token" in engine.event_names
    preprocessor = only(spans, "preprocessor")
    assert {"template_rendered", "tokenized"} <= set(preprocessor.event_names)
    for span in spans:  # every span within its parent's time
        parent = by_id(spans).get(span.parent_span_id)
        if parent is not None:
            assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns, span.name


def app(tracer: Tracer, **options: Any) -> Any:
    return build_app(
        EchoEngine.from_tokenizer(TOKENIZER, **options.pop("engine", {})),
        TOKENIZER,
        model_name="echo",
        tracer=tracer,
        **options,
    )


# -- in process --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_one_chat_request_is_one_trace_of_the_edge_each_stage_and_the_engine(
    stream: bool,
) -> None:
    with exporting() as (receiver, tracer):
        async with openai_client(app(tracer)) as client:
            if stream:
                chunks = await client.chat.completions.create(
                    model="echo",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usages = [chunk.usage async for chunk in chunks if chunk.usage]
                assert len(usages) == 1
                usage = usages[0]
            else:
                reply = await client.chat.completions.create(
                    model="echo",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=4,
                )
                usage = reply.usage
        assert usage is not None
        check_graph_trace(one_trace(receiver), usage.model_dump(), "length")
        edge = only(receiver.spans, CHAT)
        assert edge.attributes["gen_ai.request.max_tokens"] == 4
        assert edge.attributes["gen_ai.request.stream"] is stream


async def test_a_traceparent_header_joins_the_callers_trace() -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    caller = "b7ad6b7169203331"
    with exporting() as (receiver, tracer):
        async with openai_client(app(tracer)) as client:
            await client.chat.completions.create(
                model="echo",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=2,
                extra_headers={"traceparent": f"00-{trace_id}-{caller}-01"},
            )
        spans = one_trace(receiver)
    assert {span.trace_id for span in spans} == {trace_id}
    edge = only(spans, CHAT)
    assert edge.parent_span_id == caller  # the caller's span, not received here


async def test_a_request_without_a_sampled_flag_is_not_exported() -> None:
    with exporting() as (receiver, tracer):
        async with openai_client(app(tracer)) as client:
            for trace_id, flags in (("ab" * 16, "00"), ("cd" * 16, "01")):
                await client.chat.completions.create(
                    model="echo",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=2,
                    extra_headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-{flags}"},
                )
        spans = one_trace(receiver)
    assert {span.trace_id for span in spans} == {"cd" * 16}


async def test_an_inserted_operator_gets_a_span_named_after_its_class() -> None:
    with exporting() as (receiver, tracer):
        async with openai_client(app(tracer, before={"backend": [Shout()]})) as client:
            reply = await client.chat.completions.create(
                model="echo",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=3,
            )
        assert reply.choices[0].message.content == reply.choices[0].message.content.upper()
        spans = one_trace(receiver)
    shout = only(spans, "Shout")
    assert shout.attributes["llm_pipeline.operator"] == "Shout"
    assert ancestry(shout, spans)[:3] == ["Shout", "attempt", "migration"]
    assert ancestry(only(spans, "backend"), spans)[1] == "Shout"


async def test_a_migrated_request_shows_two_attempts_and_why() -> None:
    with exporting() as (receiver, tracer):
        served = app(tracer, engine={"fail_after_tokens": 2})
        async with openai_client(served) as client:
            reply = await client.chat.completions.create(
                model="echo",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=5,
            )
        assert reply.usage is not None
        spans = one_trace(receiver)
    attempts = sorted(
        (s for s in spans if s.name == "attempt"),
        key=lambda s: s.attributes["llm_pipeline.attempt"],
    )
    assert [a.attributes["llm_pipeline.attempt"] for a in attempts] == [1, 2]
    migration = only(spans, "migration")
    assert all(a.parent_span_id == migration.span_id for a in attempts)
    first, second = attempts
    assert first.status_code == 2  # error: its worker was lost
    assert "retry" in first.event_names
    assert "StreamDisconnected" in first.attributes["llm_pipeline.retry_reason"]
    assert second.status_code != 2
    assert second.attributes["llm_pipeline.replayed_tokens"] == 2
    # each attempt has its own backend and engine spans below it
    engines = [s for s in spans if s.name == "engine"]
    assert sorted(ancestry(e, spans).index("attempt") > 0 for e in engines) == [True, True]
    assert {ancestry(e, spans)[ancestry(e, spans).index("attempt")] for e in engines} == {"attempt"}
    edge = only(spans, CHAT)
    assert edge.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens


async def test_the_span_buffer_and_the_exporter_see_the_same_spans() -> None:
    buffer = SpanBuffer()
    with exporting(buffer=buffer) as (receiver, tracer):
        async with openai_client(app(tracer)) as client:
            await client.chat.completions.create(
                model="echo",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=2,
            )
        spans = one_trace(receiver)
    (recent,) = buffer.recent()
    kept = recent.as_dict()
    assert kept["trace_id"] == spans[0].trace_id
    assert sorted(s["name"] for s in kept["spans"]) == sorted(s.name for s in spans)
    assert kept["status"] == 200
    assert kept["spans"][0]["name"] == CHAT
    assert [s["depth"] for s in kept["spans"]] == sorted(s["depth"] for s in kept["spans"])


# -- end to end: the command line ------------------------------------------------------------


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=20)


@pytest.mark.slow
@pytest.mark.time_limit(60)
async def test_serve_exports_one_trace_per_chat_request() -> None:
    with OtlpReceiver() as receiver:
        server = ServerProcess("--otlp-traces-endpoint", receiver.endpoint)
        try:
            async with client(server) as api:
                reply = await api.chat.completions.create(
                    model="echo",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=6,
                )
            assert reply.usage is not None
            spans = one_trace(receiver)
            check_graph_trace(spans, reply.usage.model_dump(), "length")
            assert {span.service for span in spans} == {"llm-pipeline"}
            assert receiver.content_types == {"application/x-protobuf"}
        finally:
            server.stop()
        assert "Traceback" not in server.stderr()


@pytest.mark.slow
@pytest.mark.time_limit(60)
async def test_serve_takes_the_endpoint_and_service_name_from_opentelemetrys_variables() -> None:
    with OtlpReceiver() as receiver:
        environ = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "my-frontend",
        }
        saved = {key: os.environ.get(key) for key in environ}
        os.environ.update(environ)
        try:
            server = ServerProcess("--fail-after-tokens", "3")
        finally:
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
        try:
            async with client(server) as api:
                await api.chat.completions.create(
                    model="echo",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=6,
                )
            spans = one_trace(receiver)
        finally:
            server.stop()
    assert {span.service for span in spans} == {"my-frontend"}
    # --fail-after-tokens 3: the worker is lost once, the request migrates: two attempts
    attempts = [span for span in spans if span.name == "attempt"]
    assert len(attempts) == 2
    assert sorted(a.status_code == 2 for a in attempts) == [False, True]
