"""``llm-pipeline worker --engine llama --role prefill|decode`` processes behind ``serve
--nats``: the real model disaggregated across processes, its KV pulled worker to worker.

Answers must equal one aggregated llama server's, token for token, also when the prefill
worker is killed after it handed out a handle and before the decode worker pulled it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")
pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")

from tests.operators.cli.test_cli_nats import Deployment, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.llama]

#: the repository's root, on the workers' PYTHONPATH for ``tests.operators.cli.kill_prefill``
ROOT = str(Path(__file__).resolve().parents[3])
LLAMA = ["--engine", "llama", "--threads", "1", "--transfer-secret", "this deployment's"]
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ("What is the capital of France?", "Write a haiku about rain.", "Name a colour.")


@pytest.fixture(scope="module")
def aggregated() -> Iterator[ServerProcess]:
    server = ServerProcess("--engine", "llama", "--threads", "1")
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


async def answers(server: ServerProcess) -> list[tuple[Any, ...]]:
    found = []
    async with client(server) as api:
        for question in QUESTIONS:
            response = await api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                temperature=0,
                max_tokens=12,
                logprobs=True,
            )
            choice = response.choices[0]
            assert choice.logprobs is not None
            assert choice.logprobs.content is not None
            logprobs = [token.logprob for token in choice.logprobs.content]
            found.append((choice.message.content, choice.finish_reason, logprobs))
    return found


def start(deployment: Deployment, *frontend: str) -> None:
    """A frontend for the model (its options ``frontend``), once the workers spawned so
    far are ready and known to it."""
    deployment.frontend = ServerProcess(
        "--nats", deployment.nats.url, "--model-name", MODEL, "--log-level", "info", *frontend
    )
    for worker in deployment.workers.values():
        worker.wait_ready(60)
        deployment.wait_joined(worker.worker_id, within=30)


@pytest.mark.time_limit(180)
async def test_llama_prefill_and_decode_workers_answer_like_one_aggregated_server(
    tmp_path: Path, aggregated: ServerProcess
) -> None:
    deployment = Deployment(tmp_path)
    try:
        for worker_id, role in (("prefill-1", "prefill"), ("decode-1", "decode")):
            deployment.spawn(worker_id, *LLAMA, "--role", role)
        start(deployment)
        assert await answers(deployment.server) == await answers(aggregated)
        served = {worker_id: w.served() for worker_id, w in deployment.workers.items()}
        assert len(served["prefill-1"]) == len(served["decode-1"]) == len(QUESTIONS)
        assert {how for ended in served.values() for _, how in ended} == {"finished"}
        decode_log = deployment.workers["decode-1"].stderr()
        assert "prefilling instead" not in decode_log  # every prompt's KV was pulled
    finally:
        deployment.close()


@pytest.mark.time_limit(180)
async def test_a_prefill_worker_killed_between_handle_and_pull_is_invisible(
    tmp_path: Path, aggregated: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    deployment = Deployment(tmp_path)
    try:
        prefill = deployment.spawn("prefill-1", *LLAMA, "--role", "prefill")
        monkeypatch.setenv("LLM_PIPELINE_TEST_KILL_PID", str(prefill.process.pid))
        deployment.spawn("decode-1", *LLAMA, "--role", "decode")
        start(deployment, "--insert-before", "engine=tests.operators.cli.kill_prefill:KillPrefill")
        want = await answers(aggregated)
        got = await answers(deployment.server)  # the first one's prefill worker dies
        assert got == want
        assert prefill.process.poll() is not None  # it really was killed
        decode_log = deployment.workers["decode-1"].stderr()
        assert len(re.findall(r"KV transfer \S+ failed, prefilling instead", decode_log)) == 1
    finally:
        deployment.close()
