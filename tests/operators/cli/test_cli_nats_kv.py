"""``llm-pipeline serve --nats --router kv`` with caching ``llm-pipeline worker`` processes.

Every process is real (nats-server, the frontend, two mocker workers publishing their KV
events), driven with the official ``openai`` client: each conversation's second turn is
routed to the worker that served its first, as the frontend's /metrics show.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess
from tests.operators.cli.test_cli_nats import WorkerProcess, wait_for

pytestmark = pytest.mark.slow

#: a prompt of many blocks, shared by every conversation (as system prompts are)
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 8
#: a decode step long enough that a turn's KV events reach the frontend before it ends
MOCKER = ["--engine", "mocker", "--mocker-decode-ms-per-step", "5"]
CACHE = ["--mocker-cache-blocks", "512", "--kv-block-size", "16"]

Samples = dict[tuple[str, str], float]


class KvDeployment:
    """A nats-server, a ``serve --nats --router kv`` frontend and two caching workers."""

    def __init__(self, directory: Path) -> None:
        self.nats = NatsServer(directory)
        self.nats.start()
        self.workers = [
            WorkerProcess(self.nats.url, worker_id, *MOCKER, *CACHE)
            for worker_id in ("kv-a", "kv-b")
        ]
        self.server = ServerProcess(
            "--nats", self.nats.url, "--router", "kv", "--kv-block-size", "16",
            "--log-level", "info",
        )  # fmt: skip
        for worker in self.workers:
            worker.wait_ready()
            wait_for(lambda w=worker: f"worker {w.worker_id} joined" in self.server.stderr(), 10)

    def close(self) -> None:
        self.server.stop()
        for worker in self.workers:
            worker.stop()
        self.nats.stop()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[KvDeployment]:
    deployment = KvDeployment(tmp_path)
    try:
        yield deployment
    finally:
        deployment.close()


async def scrape(server: ServerProcess) -> Samples:
    """/metrics as {(sample name, worker label or ''): value}."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    return {
        (sample.name, sample.labels.get("worker", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def increase(before: Samples, after: Samples, name: str) -> dict[str, float]:
    """{worker label: increase} of ``name``'s samples that rose."""
    return {
        worker: value - before.get((sample, worker), 0.0)
        for (sample, worker), value in after.items()
        if sample == name and value > before.get((sample, worker), 0.0)
    }


@pytest.mark.time_limit(60)
async def test_a_conversations_next_turn_lands_on_its_first_turns_worker(
    deployment: KvDeployment,
) -> None:
    server = deployment.server
    api = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=10)
    decisions = "llm_pipeline_router_decisions_total"
    hits = "llm_pipeline_kv_hit_blocks_total"
    async with api:
        for topic in ("tides", "volcanoes", "glaciers"):
            messages: list[dict[str, str]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me about {topic}, in detail, please. " * 6},
            ]
            before = await scrape(server)
            first = await api.chat.completions.create(
                model="mocker", messages=messages, max_tokens=8
            )
            middle = await scrape(server)
            [first_worker] = increase(before, middle, decisions)

            messages += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": f"And what else about {topic}?"},
            ]
            await api.chat.completions.create(model="mocker", messages=messages, max_tokens=8)
            after = await scrape(server)
            assert increase(middle, after, decisions) == {first_worker: 1.0}, topic
            # Its first turn's blocks, seen through the KV events the worker published.
            assert increase(middle, after, hits)[""] >= 10, topic
