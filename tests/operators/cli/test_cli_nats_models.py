"""``llm-pipeline serve --nats URL`` without ``--model-name``: every model its workers
register, listed in ``/v1/models`` while it has workers.

Every process is real (nats-server, the frontend, ``worker`` processes of two models),
driven with the official ``openai`` client. Each request carries its own
``x-request-id``, and each worker logs the requests it served, so the tests see which
model's workers a request reached.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess
from tests.operators.cli.test_cli_nats import WorkerProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.time_limit(90)]

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path)
    server.start()
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=15)


def listed(server: ServerProcess) -> list[str]:
    reply = httpx.get(f"{server.base_url}/models", timeout=5)
    return [model["id"] for model in reply.json()["data"]]


def inflight(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    line = next(line for line in text.splitlines() if line.startswith("llm_pipeline_inflight"))
    return float(line.split()[-1])


async def served_by(api: openai.AsyncOpenAI, model: str, worker: WorkerProcess) -> bool:
    """Whether a request for ``model`` was served by ``worker`` (by its request id)."""
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    reply = await api.chat.completions.create(
        model=model, messages=HI, max_tokens=4, extra_headers={"x-request-id": request_id}
    )
    assert reply.model == model
    await anyio.to_thread.run_sync(
        wait_for, lambda: any(rid == request_id for rid, _ in worker.served()), 5
    )
    return True


async def test_every_registered_model_is_served_and_listed_while_it_has_workers(
    nats: NatsServer,
) -> None:
    frontend = ServerProcess("--nats", nats.url, "--log-level", "info", "--worker-wait", "1")
    workers = [
        WorkerProcess(nats.url, "a-1", "--model-name", "alpha"),
        WorkerProcess(nats.url, "b-1", "--model-name", "beta/v2", "--echo-delay-ms", "40"),
    ]
    try:
        assert frontend.model == "*"  # every model: none is known at start
        for worker in workers:
            worker.wait_ready()
        wait_for(lambda: sorted(listed(frontend)) == ["alpha", "beta/v2"], 10)
        alpha, beta = workers
        async with client(frontend) as api:
            assert await served_by(api, "alpha", alpha)
            assert await served_by(api, "beta/v2", beta)
            with pytest.raises(openai.NotFoundError) as unknown:
                await api.chat.completions.create(model="gamma", messages=HI)
            assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]

            # A request in flight when the last worker of its model dies ends with a 503
            # (after --worker-wait), never a hang; the model leaves /v1/models.
            async def doomed() -> None:
                with pytest.raises(openai.APIStatusError) as cut:
                    await api.chat.completions.create(model="beta/v2", messages=HI, max_tokens=200)
                assert cut.value.status_code == 503

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                await anyio.to_thread.run_sync(wait_for, lambda: inflight(frontend) == 1, 5)
                beta.process.kill()  # (wherever the request is: the outcome is the same)
                beta.process.wait(10)
            await anyio.to_thread.run_sync(wait_for, lambda: listed(frontend) == ["alpha"], 15)
            with pytest.raises(openai.NotFoundError):
                await api.chat.completions.create(model="beta/v2", messages=HI)

            # The other leaves gracefully: no model is left; one that comes back is listed.
            alpha.signal(signal.SIGTERM)
            assert alpha.wait() == 0
            await anyio.to_thread.run_sync(wait_for, lambda: listed(frontend) == [], 10)
            back = WorkerProcess(nats.url, "b-2", "--model-name", "beta/v2")
            workers.append(back)
            back.wait_ready()
            await anyio.to_thread.run_sync(wait_for, lambda: listed(frontend) == ["beta/v2"], 10)
            assert await served_by(api, "beta/v2", back)
    finally:
        frontend.stop()
        for worker in workers:
            worker.stop()
    assert "Traceback" not in frontend.stderr()
