"""Stored responses under ``serve --nats``: one conversation across two frontends, and
across a frontend's restart.

Every process is real (a nats-server, an echo worker, two ``serve --nats`` frontends) and
is driven with the official ``openai`` client. The records live in the NATS server's
JetStream bucket, so a frontend that never saw a response, or one started after it was
made, continues it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess
from tests.operators.cli.test_cli_nats import WorkerProcess, wait_for

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


class Cluster:
    """A nats-server, an echo worker and frontends started on demand."""

    def __init__(self, directory: Path) -> None:
        self.template = directory / "roles.jinja"
        self.template.write_text(TEMPLATE)
        self.nats = NatsServer(directory)
        self.nats.start()
        self.worker = WorkerProcess(self.nats.url, "echo-1").wait_ready()
        self.frontends: list[ServerProcess] = []

    def frontend(self, *options: str) -> ServerProcess:
        """A ``serve --nats`` frontend that knows the worker."""
        server = ServerProcess(
            "--nats", self.nats.url, "--chat-template", str(self.template), "--log-level",
            "info", *options,
        )  # fmt: skip
        self.frontends.append(server)
        wait_for(lambda: "worker echo-1 joined" in server.stderr(), 10)
        return server

    def close(self) -> None:
        for server in self.frontends:
            server.stop()
        self.worker.stop()
        self.nats.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path)
    try:
        yield running
    finally:
        running.close()


def client(server: ServerProcess, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=10)


@pytest.mark.time_limit(60)
async def test_a_conversation_continues_on_another_frontend_and_after_a_restart(
    cluster: Cluster,
) -> None:
    a, b = cluster.frontend(), cluster.frontend()
    async with client(a) as on_a, client(b) as on_b:
        first = await on_a.responses.create(model="echo", input="Hi from A")
        assert first.output_text == "[user]Hi from A"
        async with on_b.responses.stream(
            model="echo", input="now B", previous_response_id=first.id
        ) as stream:
            second = await stream.get_final_response()
        assert second.output_text == "[user]Hi from A[assistant][user]Hi from A[user]now B"
        assert (await on_a.responses.retrieve(second.id)).output_text == second.output_text
    a.stop()  # a frontend restarts: the conversation lives in NATS, not in it
    restarted = cluster.frontend()
    async with client(restarted) as again, client(b) as on_b:
        third = await again.responses.create(
            model="echo", input="and A again", previous_response_id=second.id
        )
        assert third.output_text.endswith(
            "[user]now B[assistant]" + second.output_text + "[user]and A again"
        )
        items = [item async for item in again.responses.input_items.list(third.id, order="asc")]
        assert [getattr(item, "role", None) for item in items] == [
            "user", "assistant", "user", "assistant", "user",
        ]  # fmt: skip
        await on_b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await again.responses.retrieve(first.id)
        # the later records hold their whole conversation: deleting the first breaks nothing
        fourth = await again.responses.create(
            model="echo", input="still here", previous_response_id=third.id
        )
        assert fourth.output_text.startswith("[user]Hi from A")


@pytest.mark.time_limit(60)
async def test_a_large_response_is_stored_in_parts_and_keys_scope_it(cluster: Cluster) -> None:
    a = cluster.frontend("--api-key", "k1", "--api-key", "k2")
    b = cluster.frontend("--api-key", "k1", "--api-key", "k2")
    big = "word " * 300_000  # ~1.5 MB of text: more than one NATS message (1 MB)
    async with client(a, "k1") as mine, client(b, "k1") as also_mine, client(b, "k2") as other:
        made = await mine.responses.create(model="echo", input=big, max_output_tokens=1)
        again = await also_mine.responses.input_items.list(made.id)
        assert again.data[0].content[0].text == big  # type: ignore[union-attr]
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(made.id)
    async with httpx.AsyncClient(timeout=10) as http:
        health = await http.get(f"{b.url}/health")
    assert health.status_code == 200
