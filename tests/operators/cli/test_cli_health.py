"""Health end to end, with real processes and the official client: the probes of ``serve``
during a drain and before a ``serve --nats`` frontend has workers, a busy port, and over
NATS the workers' own watchdogs: a worker is routed to only once its engine answered a
probe (one whose engine fails or never answers, never), one whose engine freezes has its
streams migrate (identically) while the frontend stays ready, and with every worker
frozen the frontend is not ready."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from tests.helpers.client_view import chat_stream
from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess, run_cli
from tests.operators.cli.test_cli_nats import (
    MOCKER,
    WorkerProcess,
    chat,
    metric,
    wait_for,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.time_limit(60)]


def probes(server: ServerProcess) -> dict[str, tuple[int, Any]]:
    found = {}
    for path in ("/live", "/ready", "/health"):
        response = httpx.get(f"{server.url}{path}", timeout=5)
        found[path] = (response.status_code, response.json())
    return found


def api(server: ServerProcess, timeout: float = 30) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=timeout)


def test_serve_on_a_busy_port_says_so_in_one_line_and_exits_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(["serve", "--port", str(port)])
    assert result.returncode == 2
    assert (
        result.stderr
        == f"llm-pipeline: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )
    assert result.stdout == ""


async def test_a_draining_server_is_alive_but_not_ready() -> None:
    server = ServerProcess("--echo-delay-ms", "40")
    try:
        assert probes(server)["/ready"] == (
            200,
            {"status": "ready", "models": {"echo": {"ready": True}}},
        )
        started = anyio.Event()
        async with api(server) as client, anyio.create_task_group() as tg:
            answers: list[dict[str, Any]] = []

            async def long_stream() -> None:
                answers.append(await chat_stream(client, started=started, **chat("a " * 40)))

            tg.start_soon(long_stream)
            await started.wait()
            server.process.send_signal(signal.SIGTERM)
            await wait_until(lambda: probes(server)["/ready"][0] == 503, 5)
            found = probes(server)
            assert found["/ready"][1]["reason"] == "draining"
            assert found["/live"] == (200, {"status": "live"})
            assert found["/health"] == (503, {"status": "draining"})
        assert answers[0]["finishes"] == ["stop"]  # the drain let it finish
        assert server.process.wait(15) == 0
    finally:
        server.stop()


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Workers:
    """The worker processes a test starts, all stopped at its end."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.started: list[WorkerProcess] = []

    def start(self, worker_id: str, *options: str) -> WorkerProcess:
        worker = WorkerProcess(self.url, worker_id, *options)
        self.started.append(worker)
        return worker.wait_ready()

    def stop(self) -> None:
        for worker in self.started:
            worker.stop()


@pytest.fixture
def workers(nats: NatsServer) -> Iterator[Workers]:
    started = Workers(nats.url)
    try:
        yield started
    finally:
        started.stop()


def test_a_frontend_without_workers_is_healthy_but_not_ready(
    nats: NatsServer, workers: Workers
) -> None:
    server = ServerProcess("--nats", nats.url, "--model-name", "mocker", "--log-level", "info")
    try:
        found = probes(server)
        assert found["/live"] == (200, {"status": "live"})
        assert found["/health"] == (200, {"status": "ok"})
        assert found["/ready"] == (
            503,
            {
                "status": "not_ready",
                "models": {
                    "mocker": {
                        "ready": False,
                        "reason": "no worker has joined 'mocker decode' yet",
                    }
                },
            },
        )
        workers.start("w-1", *MOCKER)
        wait_for(lambda: probes(server)["/ready"][0] == 200, 10)
    finally:
        server.stop()


async def test_a_worker_is_routed_to_only_once_its_engine_answered_a_probe(
    nats: NatsServer, workers: Workers
) -> None:
    server = ServerProcess("--nats", nats.url, "--log-level", "info")
    try:
        workers.start("good", *MOCKER)
        # Loaded, but every first attempt it takes fails (its first probe too)...
        workers.start("bad", *MOCKER, "--fail-after-tokens", "0")
        # ...and one whose engine never answers at all (frozen before its first token).
        workers.start("frozen", *MOCKER, "--freeze-after-tokens", "0")
        wait_for(lambda: "worker good joined" in server.stderr(), 15)
        wait_for(lambda: "worker bad is not ready: probe failed" in server.stderr(), 15)
        unanswered = "worker frozen is not ready: starting: its engine has not answered a probe"
        wait_for(lambda: unanswered in server.stderr(), 15)
        assert probes(server)["/ready"][0] == 200  # (the good one serves the model)
        async with api(server) as client:
            for i in range(8):
                answer = await chat_stream(
                    client, model="mocker", **chat(f"request {i}", max_tokens=5)
                )
                assert answer["finishes"] == ["length"]
        good, bad, frozen = workers.started
        assert len(good.served()) == 8
        assert bad.served() == []  # (probes enter below the request log)
        assert frozen.served() == []
        assert "worker bad joined" not in server.stderr()
        assert "worker frozen joined" not in server.stderr()
    finally:
        server.stop()


async def test_a_frozen_workers_streams_migrate_and_with_every_worker_frozen_none_is_ready(
    nats: NatsServer, workers: Workers
) -> None:
    stall = ["--stall-timeout", "1"]
    reference = ServerProcess(*MOCKER)
    server = ServerProcess("--nats", nats.url, "--log-level", "info", "--worker-wait", "1")
    try:
        # (a test hook: the mocker freezes after so many tokens in all, as under SIGSTOP)
        workers.start("frozen", *MOCKER, *stall, "--freeze-after-tokens", "20")
        workers.start("steady", *MOCKER, *stall, "--freeze-after-tokens", "150")
        for worker_id in ("frozen", "steady"):
            wait_for(lambda w=worker_id: f"worker {w} joined" in server.stderr(), 10)
        requests = [chat(f"the {i}th of two streams, long enough", max_tokens=60) for i in (1, 2)]
        async with api(reference) as local:
            expected = [await chat_stream(local, model="mocker", **request) for request in requests]
        answers: list[dict[str, Any]] = [{}, {}]
        async with api(server) as client, anyio.create_task_group() as tg:
            for i, request in enumerate(requests):

                async def one(i: int = i, request: dict[str, Any] = request) -> None:
                    answers[i] = await chat_stream(client, model="mocker", **request)

                tg.start_soon(one)
        assert answers == expected  # one of them migrated mid-stream, invisibly
        assert "worker frozen is not ready: engine stalled" in server.stderr()
        retried = 'llm_pipeline_migrations_total{kind="stream",outcome="retried"}'
        assert await metric(server, retried) >= 1
        found = probes(server)
        assert found["/ready"][0] == 200  # the steady one still serves
        # Now the steady one freezes too (past 150 tokens): nothing is ready.
        async with api(server) as client:
            with pytest.raises(openai.APIError) as failed:
                await chat_stream(client, model="mocker", **chat("a third stream", max_tokens=60))
        # (retried on the one worker there is, which refuses it: or none left at all)
        assert failed.value.code == "engine_unavailable" or "no worker" in failed.value.message
        wait_for(lambda: probes(server)["/ready"][0] == 503, 10)
        ready = probes(server)["/ready"][1]
        assert ready["status"] == "not_ready"
        assert "worker steady is not ready: engine stalled" in server.stderr()
        assert probes(server)["/live"][0] == 200
    finally:
        server.stop()
        reference.stop()
