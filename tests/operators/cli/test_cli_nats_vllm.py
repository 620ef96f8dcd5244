"""KV-aware routing over vLLM workers: two ``llm-pipeline worker --engine vllm`` processes
behind ``llm-pipeline serve --nats --router kv``.

Each worker translates vLLM's KV cache events into our block ids and publishes them; the
frontend routes a conversation's next turn to the worker whose cache holds its first turn,
which then reports the reused prompt as ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from operators.engines.vllm._reaper import descendants
from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess
from tests.helpers.vllm_support import gone, requires_vllm
from tests.operators.cli.test_cli_nats import WorkerProcess, wait_for
from tests.operators.cli.test_cli_nats_kv import increase, scrape

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.time_limit(120)]

MODEL = "SmolLM2-135M-Instruct"
VLLM = ["--engine", "vllm", "--max-model-len", "1024", "--kv-block-size", "16"]
#: a system prompt of several blocks, shared by every conversation
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6


class VllmDeployment:
    """A nats-server, a ``serve --nats --router kv`` frontend and two vLLM workers."""

    def __init__(self, directory: Path) -> None:
        self.nats = NatsServer(directory)
        self.nats.start()
        self.workers = [
            WorkerProcess(self.nats.url, worker_id, *VLLM) for worker_id in ("vllm-a", "vllm-b")
        ]
        self.processes: set[int] = set()
        self.server: ServerProcess | None = None
        for worker in self.workers:  # (both load at once)
            worker.wait_ready(timeout=300)
            self.processes |= descendants(worker.process.pid)
        self.server = ServerProcess(
            "--nats", self.nats.url, "--model-name", MODEL, "--router", "kv",
            "--kv-block-size", "16", "--log-level", "info",
        )  # fmt: skip
        for worker in self.workers:
            wait_for(lambda w=worker: f"worker {w.worker_id} joined" in self.stderr(), 30)

    def stderr(self) -> str:
        return self.server.stderr() if self.server is not None else ""

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        for worker in self.workers:
            worker.stop()  # (a kill: vLLM's processes must not outlive it)
        self.nats.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmDeployment]:
    requires_vllm()
    deployment = VllmDeployment(tmp_path_factory.mktemp("nats"))
    try:
        yield deployment
    finally:
        deployment.close()
    assert len(deployment.processes) >= 4
    assert gone(deployment.processes), "vLLM processes outlived their killed workers"


async def test_a_conversations_next_turn_lands_on_its_worker_and_reuses_its_cache(
    deployment: VllmDeployment,
) -> None:
    server = deployment.server
    assert server is not None
    api = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=100)
    decisions = "llm_pipeline_router_decisions_total"
    chosen: set[str] = set()
    async with api:
        for topic in ("tides", "volcanoes", "glaciers"):
            messages: list[dict[str, str]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me about {topic}, in detail, please. " * 4},
            ]
            before = await scrape(server)
            first = await api.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            middle = await scrape(server)
            [first_worker] = increase(before, middle, decisions)
            chosen.add(first_worker)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": f"And what else about {topic}?"},
            ]
            second = await api.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            after = await scrape(server)
            assert increase(middle, after, decisions) == {first_worker: 1.0}, topic
            # its first turn's blocks, as the worker's KV events announced them
            assert increase(middle, after, "llm_pipeline_kv_hit_blocks_total")[""] >= 8, topic
            details = second.usage.prompt_tokens_details
            assert details is not None
            assert details.cached_tokens is not None
            assert details.cached_tokens >= first.usage.prompt_tokens - 32, topic
    assert chosen <= {"vllm-a", "vllm-b"}
