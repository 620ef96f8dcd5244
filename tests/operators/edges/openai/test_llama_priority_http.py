"""Priorities on the llama engine, as a user sees them: ``serve --engine llama --parallel 1``
as a subprocess and the official ``openai`` client. While one request holds the only
slot, four low-priority requests queue, then a high-priority one: it is answered first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.time_limit(120)]

pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")

HI: Any = [{"role": "user", "content": "Tell me a long story about a cat."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--engine", "llama", "--parallel", "1", startup_timeout=60)
    yield process
    process.stop()
    assert "Traceback" not in process.stderr()


def waiting(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    name = "llm_pipeline_llama_waiting_sequences"
    return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])


def wait_until_waiting(server: ServerProcess, count: int) -> None:
    """Poll the server's queue (another process) until ``count`` requests wait in it."""
    deadline = time.monotonic() + 20
    while waiting(server) != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} requests never waited (now {waiting(server)})")
        time.sleep(0.02)


async def test_a_high_priority_request_overtakes_the_low_priority_queue(
    server: ServerProcess,
) -> None:
    firsts: list[str] = []
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="x", max_retries=0, timeout=60
    ) as api:

        async def queued(name: str, priority: int) -> None:
            stream = await api.chat.completions.create(
                model=server.model,
                messages=HI,
                max_tokens=3,
                stream=True,
                extra_body={"priority": priority},
            )
            async with stream:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        firsts.append(name)
                        break

        running = await api.chat.completions.create(
            model=server.model,
            messages=HI,
            max_tokens=1000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async with running:
            await anext(aiter(running))  # it runs: it holds the only slot
            async with anyio.create_task_group() as tg:
                order = [("low-1", 10), ("low-2", 10), ("low-3", 10), ("low-4", 10), ("high", -10)]
                for count, (name, priority) in enumerate(order, 1):
                    tg.start_soon(queued, name, priority)
                    await anyio.to_thread.run_sync(wait_until_waiting, server, count)
                await running.close()  # the slot is free: who goes first?
    assert sorted(firsts) == ["high", "low-1", "low-2", "low-3", "low-4"]
    assert firsts[0] == "high"
    assert firsts[1:] == ["low-1", "low-2", "low-3", "low-4"]  # then in arrival order
