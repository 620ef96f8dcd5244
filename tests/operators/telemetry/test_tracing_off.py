"""Off means off, and ``--log-format json``.

``serve --no-ui`` without an OTLP endpoint records nothing: after serving requests the
process has made no span and imported no ``opentelemetry`` module (``serve_probe`` runs
the command line's own ``main`` and looks). With the UI (the default) it records spans in
process, still without OpenTelemetry. ``--log-format json`` writes one JSON object per
line on stderr, one per request with its id, trace id, model, status, tokens, TTFT and
duration.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

#: the repository's root, where ``python -m`` finds the probe (and the project)
ROOT = Path(__file__).resolve().parents[3]


def probe(*options: str) -> dict[str, object]:
    run = subprocess.run(
        [sys.executable, "-m", "tests.operators.telemetry.serve_probe", *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout
    report: dict[str, object] = json.loads(lines[0])
    return report


def test_tracing_off_imports_no_opentelemetry_and_makes_no_span() -> None:
    assert probe("--no-ui") == {"opentelemetry": [], "spans": 0}


def test_the_ui_records_spans_in_process_without_opentelemetry() -> None:
    report = probe()
    assert report["opentelemetry"] == []
    spans = report["spans"]
    assert isinstance(spans, int)
    assert spans >= 3 * 9  # three requests: the edge, six stages, an attempt, the engine...


def test_a_json_log_alone_records_only_each_requests_own_span() -> None:
    assert probe("--no-ui", "--log-format", "json") == {"opentelemetry": [], "spans": 3}


@pytest.mark.time_limit(60)
async def test_log_format_json_writes_one_line_per_request() -> None:
    server = ServerProcess("--log-format", "json", "--no-ui")
    try:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="x", max_retries=0, timeout=20
        ) as api:
            reply = await api.chat.completions.with_raw_response.create(
                model="echo",
                messages=[{"role": "user", "content": "Hi JSON"}],
                max_tokens=4,
                extra_headers={"x-request-id": "json-log-1"},
            )
            parsed = reply.parse()
            stream = await api.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "Hi JSON"}],
                max_tokens=3,
                stream=True,
                extra_headers={"x-request-id": "json-log-2"},
            )
            async for _ in stream:
                pass
            with pytest.raises(openai.NotFoundError):
                await api.chat.completions.create(
                    model="other",
                    messages=[{"role": "user", "content": "Hi"}],
                    extra_headers={"x-request-id": "json-log-3"},
                )
        async with httpx.AsyncClient() as http:  # not a generation request: no line
            assert (await http.get(f"{server.url}/health")).status_code == 200
    finally:
        server.stop()
    lines = [json.loads(line) for line in server.stderr().splitlines() if line.strip()]
    requests = [line for line in lines if line["logger"] == "llm_pipeline.requests"]
    assert len(requests) == 3
    first, second, refused = requests
    assert parsed.usage is not None
    assert first["request_id"] == "json-log-1"
    assert first["model"] == "echo"
    assert first["status"] == 200
    assert first["tokens"] == first["completion_tokens"] == parsed.usage.completion_tokens
    assert first["prompt_tokens"] == parsed.usage.prompt_tokens
    assert len(first["trace_id"]) == 32
    assert int(first["trace_id"], 16)
    assert first["ttft_ms"] > 0
    assert first["duration_ms"] >= first["ttft_ms"]
    assert first["level"] == "info"
    assert first["time"].endswith("Z")
    assert second["request_id"] == "json-log-2"
    assert second["tokens"] == 3
    assert second["finish_reasons"] == ["length"]
    assert refused["status"] == 404
    assert refused["request_id"] == "json-log-3"
    assert refused["tokens"] is None
    assert refused["ttft_ms"] is None
    assert len({first["trace_id"], second["trace_id"], refused["trace_id"]}) == 3
