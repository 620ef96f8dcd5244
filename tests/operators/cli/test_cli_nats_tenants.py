"""A key's limits across frontends (``serve --nats --api-keys FILE``): two frontends admit,
together, what one would (within one request); the budgets' bucket itself
(:class:`~operators.edges.http.nats_budgets.NatsBudgets`) is exact under concurrent
frontends, and when NATS cannot be reached each frontend keeps its share of every limit,
saying so once."""

from __future__ import annotations

import logging
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import anyio
import httpx
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from operators.edges.http.limits import Ask, Limits
from operators.edges.http.nats_budgets import NatsBudgets
from operators.edges.http.tenants import Tenant
from tests.helpers.nats_server import NatsServer, connect
from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow


class Worker:
    """``llm-pipeline worker --engine echo`` over NATS, until stopped."""

    def __init__(self, url: str) -> None:
        self._stderr: IO[bytes] = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "operators.cli", "worker", "--nats", url],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            ready = selector.select(30)
        if not ready or "serving model" not in self.process.stdout.readline().decode():
            self.stop()
            raise RuntimeError("the worker did not start")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.time_limit(60)
async def test_two_frontends_admit_together_what_one_key_may(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "a"\nkey = "sk-a"\nrequests_per_minute = 10\n')
    worker = Worker(nats_server.url)
    frontends: list[ServerProcess] = []
    try:
        for _ in range(2):
            frontends.append(
                ServerProcess(
                    "--nats", nats_server.url, "--model-name", "echo", "--api-keys", str(keys)
                )
            )
        statuses: list[int] = []
        async with httpx.AsyncClient(timeout=30) as http:

            async def ask(frontend: ServerProcess) -> None:
                answer = await http.post(
                    f"{frontend.base_url}/completions",
                    json={"model": "echo", "prompt": "hi", "max_tokens": 2},
                    headers={"authorization": "Bearer sk-a"},
                )
                statuses.append(answer.status_code)

            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                for number in range(24):  # together, on both frontends
                    tg.start_soon(ask, frontends[number % 2])
            refilled = (time.monotonic() - started) / 6  # (one a minute's tenth: every 6 s)
        # a minute's 10, and what refilled while they ran, ±1 request
        assert set(statuses) == {200, 429}
        assert 10 <= statuses.count(200) <= 10 + refilled + 1
        assert all("cannot be reached" not in f.stderr() for f in frontends)
    finally:
        for frontend in frontends:
            frontend.stop()
        worker.stop()


def tenant(**limits: int) -> Tenant:
    return Tenant(name="t", digest=b"x", limits=Limits(**limits))


@pytest.mark.time_limit(30)
async def test_the_bucket_is_exact_under_concurrent_frontends(nats_server: NatsServer) -> None:
    """Three frontends, 90 concurrent takes of one key with 40 requests and 400 tokens a
    minute: exactly what the limits hold is admitted, whoever raced."""
    clients = [await connect(nats_server) for _ in range(3)]
    try:
        budgets = [await NatsBudgets.open(nc) for nc in clients]
        key = tenant(requests_per_minute=40, tokens_per_minute=400)
        verdicts = []

        async def take(budget: NatsBudgets) -> None:
            verdicts.append(await budget.take(key, Ask(requests=1, tokens=7)))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for number in range(90):
                tg.start_soon(take, budgets[number % 3])
        refilled = (time.monotonic() - started) * 40 / 60
        admitted = [v for v in verdicts if v.admitted]
        # 400 // 7 = 57 by tokens, 40 by requests, and what refilled in the meantime
        assert 40 <= len(admitted) <= 40 + refilled
        assert all(v.refused_by == "requests" for v in verdicts if not v.admitted)
        # given back on one frontend, taken on another
        for _ in range(5):
            await budgets[0].give(key, Ask(requests=1))
        assert (await budgets[2].take(key, Ask(requests=5))).admitted
    finally:
        for nc in clients:
            await nc.close()


@pytest.mark.time_limit(30)
async def test_without_nats_each_frontend_keeps_its_share_and_says_so_once(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    clients = [await connect(nats_server) for _ in range(2)]
    try:
        budgets = [await NatsBudgets.open(nc, frontend=f"f{n}") for n, nc in enumerate(clients)]
        for budget in budgets:
            await budget.beat()
        await budgets[0].beat()  # (each has now seen the other)
        assert budgets[0].frontends == {"f0", "f1"}
        key = tenant(requests_per_minute=10)
        nats_server.stop()
        with caplog.at_level(logging.WARNING, "operators.edges.http.nats_budgets"):
            verdicts = [await budgets[0].take(key, Ask(requests=1)) for _ in range(8)]
        assert [v.admitted for v in verdicts] == [True] * 5 + [False] * 3  # 10 / 2 frontends
        said = [r.getMessage() for r in caplog.records if "cannot be reached" in r.getMessage()]
        assert len(said) == 1
        assert "1/2 of every key's limits" in said[0]
        caplog.clear()
        nats_server.start()
        with anyio.fail_after(10):
            while not clients[0].is_connected:  # noqa: ASYNC110 - nats-py's reconnection
                await anyio.sleep(0.05)
        with caplog.at_level(logging.WARNING, "operators.edges.http.nats_budgets"):
            assert (await budgets[0].take(key, Ask(requests=1))).admitted  # shared again
        assert any("is back" in r.getMessage() for r in caplog.records)
    finally:
        for nc in clients:
            await nc.close()
