"""Traces across the NATS hop: ``serve --nats`` and a ``worker``, both exporting.

The request carries its trace context to the worker (its frontend engine span's
``traceparent``, in the request's metadata): the worker's spans share the trace id and
hang under the frontend's engine span, and the collector receives both services.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess
from tests.operators.cli.test_cli_nats import WorkerProcess, wait_for
from tests.operators.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

CHAT = "POST /v1/chat/completions"


class TracedDeployment:
    """A nats-server, one echo worker and a ``serve --nats`` frontend, both exporting to
    ``receiver``; the worker loses its stream after ``fail_after`` tokens if given."""

    def __init__(self, directory: Path, receiver: OtlpReceiver) -> None:
        self.nats = NatsServer(directory)
        self.nats.start()
        self.worker: WorkerProcess | None = None
        self.server: ServerProcess | None = None
        self.receiver = receiver

    def start(self, *worker_options: str) -> TracedDeployment:
        endpoint = ("--otlp-traces-endpoint", self.receiver.endpoint)
        self.worker = WorkerProcess(self.nats.url, "w1", *endpoint, *worker_options)
        self.server = ServerProcess("--nats", self.nats.url, *endpoint, "--log-level", "info")
        self.worker.wait_ready()
        server = self.server
        wait_for(lambda: "worker w1 joined" in server.stderr(), 10)
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.worker is not None:
            self.worker.stop()
        self.nats.stop()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[TracedDeployment]:
    with OtlpReceiver() as receiver:
        deployment = TracedDeployment(tmp_path, receiver)
        try:
            yield deployment
        finally:
            deployment.close()


def ancestry(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[str]:
    index = {s.span_id: s for s in spans}
    names = [span.name]
    while span.parent_span_id in index:
        span = index[span.parent_span_id]
        names.append(span.name)
    return names


@pytest.mark.time_limit(90)
async def test_the_workers_spans_hang_under_the_frontends_engine_span(
    deployment: TracedDeployment,
) -> None:
    deployment.start()
    assert deployment.server is not None
    async with openai.AsyncOpenAI(
        base_url=deployment.server.base_url, api_key="x", max_retries=0, timeout=20
    ) as api:
        reply = await api.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "Hello over NATS"}], max_tokens=5
        )
    assert reply.usage is not None
    spans = deployment.receiver.wait_for(
        lambda s: any(x.name == CHAT for x in s) and any(x.name == "worker" for x in s), 20
    )
    assert len({span.trace_id for span in spans}) == 1
    frontend = [s for s in spans if s.service == "llm-pipeline"]
    worker = [s for s in spans if s.service == "llm-pipeline-worker"]
    assert frontend
    assert worker
    engine = next(s for s in frontend if s.name == "engine")
    assert engine.attributes["llm_pipeline.operator"] == "Router"
    assert engine.attributes["llm_pipeline.worker.id"] == "w1"
    root = next(s for s in worker if s.name == "worker")
    assert root.parent_span_id == engine.span_id
    assert root.kind == "server"
    assert root.attributes["llm_pipeline.worker.id"] == "w1"
    assert "dequeued" in root.event_names
    # below the worker's span: the worker's own graph (its request log, a constraint guard
    # in front of an engine that does not decode constrained, then its engine)
    worker_engine = next(s for s in worker if s.name == "engine")
    below = ancestry(worker_engine, spans)
    below = below[: below.index("worker") + 1]
    assert below[0] == "engine"
    assert below[-2:] == ["RequestLog", "worker"]
    assert set(below[1:-2]) <= {"ConstraintGuard"}
    assert "first_token" in worker_engine.event_names
    # the whole path, from the worker's engine up to the frontend's edge
    path = ancestry(worker_engine, spans)
    assert path[-1] == CHAT
    assert path.index("worker") < path.index("engine", 1) < path.index("backend")
    edge = next(s for s in frontend if s.name == CHAT)
    assert edge.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    assert edge.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens


@pytest.mark.time_limit(90)
async def test_a_migrated_request_over_nats_shows_two_attempts_each_with_its_worker_span(
    deployment: TracedDeployment,
) -> None:
    deployment.start("--fail-after-tokens", "3")
    assert deployment.server is not None
    async with openai.AsyncOpenAI(
        base_url=deployment.server.base_url, api_key="x", max_retries=0, timeout=20
    ) as api:
        reply = await api.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "Hello over NATS"}], max_tokens=6
        )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 6
    spans = deployment.receiver.wait_for(
        lambda s: any(x.name == CHAT for x in s) and sum(x.name == "worker" for x in s) >= 2, 20
    )
    attempts = sorted(
        (s for s in spans if s.name == "attempt"),
        key=lambda s: s.attributes["llm_pipeline.attempt"],
    )
    assert len(attempts) == 2
    assert attempts[0].status_code == 2
    assert "retry" in attempts[0].event_names
    workers = [s for s in spans if s.name == "worker"]
    # each attempt reached the worker: one worker span under each attempt
    index = {s.span_id: s for s in spans}
    under = []
    for worker in workers:
        span = worker
        while span.name != "attempt":
            span = index[span.parent_span_id]
        under.append(span.attributes["llm_pipeline.attempt"])
    assert sorted(under) == [1, 2]
