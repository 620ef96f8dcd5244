"""A vLLM engine core that freezes or dies, from outside, as in production: ``serve`` with a
real vLLM (CPU build), its ``VLLM::EngineCore`` process signalled by pid.

One server runs the whole story (a vLLM start takes most of a minute): SIGSTOP of the engine
core (the stream ends with a 503, new requests are refused at once, SIGCONT brings it back),
kill -9 (the stream ends with a 503 within 2 s, ``/live`` stays 200 while it is rebuilt, the
rebuilt engine answers as before), and a second kill -9 past its one restart (``/live`` 503,
then the process exits non-zero once the other model's stream has drained). It runs with a
torchvision that cannot be imported first on its ``PYTHONPATH`` (PyPI's torchvision beside
the CPU torch does that): vLLM must load anyway, in its own processes too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import psutil
import pytest

from tests.helpers.server_process import ServerProcess
from tests.helpers.vllm_support import requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.time_limit(600)]

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colours are"
STALL = 5.0


def engine_core(server: ServerProcess) -> psutil.Process:
    """The server's vLLM engine core (a new one after each rebuild)."""
    found = [
        child
        for child in psutil.Process(server.process.pid).children(recursive=True)
        if child.name().startswith("VLLM::EngineCore")
    ]
    assert len(found) == 1, found
    return found[0]


def get(server: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", timeout=5)


def until(condition: Any, within: float, what: str) -> float:
    """Poll ``condition`` (another process's state) until it holds; the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > within:
            raise AssertionError(f"{what}: not within {within:g} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def broken_torchvision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose torchvision raises as PyPI's does beside the CPU torch."""
    folder = tmp_path_factory.mktemp("broken")
    (folder / "torchvision").mkdir()
    (folder / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    return folder


@pytest.fixture(scope="module")
def server(
    broken_torchvision: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    requires_vllm()
    models = tmp_path_factory.mktemp("models") / "models.toml"
    models.write_text(
        f'[[model]]\nname = "{MODEL}"\nengine = "vllm"\nmax-model-len = 1024\n\n'
        '[[model]]\nname = "echo"\nengine = "echo"\necho-delay-ms = 50\necho-cycle = true\n'
    )
    paths = [str(broken_torchvision), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    try:
        process = ServerProcess(
            "--models", str(models), "--stall-timeout", str(STALL), "--engine-restarts", "1",
            "--log-level", "info", startup_timeout=300,
        )  # fmt: skip
    finally:
        os.environ["PYTHONPATH"] = paths[1]
        if not paths[1]:
            del os.environ["PYTHONPATH"]
    try:
        yield process
    finally:
        process.stop()


Outcome = tuple[str, openai.APIError | None, float]


async def stream_until_error(
    client: openai.AsyncOpenAI, started: anyio.Event, model: str = MODEL, tokens: int = 400
) -> Outcome:
    """Stream a long completion; its text, the error event that ended it (if one did), and
    when it ended (``time.monotonic()``)."""
    text = ""
    chunks = 0
    try:
        stream = await client.completions.create(
            model=model, prompt="Tell me a long story about a dragon.", max_tokens=tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            text += chunk.choices[0].text
            chunks += 1
            if chunks == 3:
                started.set()
    except openai.APIError as exc:
        return text, exc, time.monotonic()
    return text, None, time.monotonic()


async def answer(client: openai.AsyncOpenAI) -> str:
    reply = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0
    )
    return reply.choices[0].text


async def test_a_frozen_or_killed_engine_core_is_refused_rebuilt_and_at_last_ends_the_process(
    server: ServerProcess,
) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    async with client:
        expected = await answer(client)
        assert "torchvision is installed but cannot be imported" in server.stderr()

        # -- SIGSTOP: a frozen engine core
        core = engine_core(server)
        started = anyio.Event()
        async with anyio.create_task_group() as tg:
            outcome: list[Outcome] = []

            async def streaming() -> None:
                outcome.append(await stream_until_error(client, started))

            tg.start_soon(streaming)
            await started.wait()
            core.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            took = await anyio.to_thread.run_sync(
                lambda: until(lambda: get(server, "/ready").status_code == 503, STALL + 1, "/ready")
            )
        [(text, error, ended)] = outcome
        assert took <= STALL + 1
        assert error is not None, text
        assert error.code == "engine_unavailable"
        assert "engine stalled: no output for" in error.message
        assert ended - stopped <= STALL + 1
        assert text  # (what came before the stall)
        began = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert time.monotonic() - began < 1  # at once
        assert refused.value.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert get(server, "/live").status_code == 200
        core.send_signal(signal.SIGCONT)
        await anyio.to_thread.run_sync(
            lambda: until(lambda: get(server, "/ready").status_code == 200, 30, "ready again")
        )
        assert await answer(client) == expected

        # -- kill -9: a dead engine core, rebuilt
        started = anyio.Event()
        async with anyio.create_task_group() as tg:
            outcome = []
            tg.start_soon(streaming)
            await started.wait()
            core = engine_core(server)
            core.kill()
            killed = time.monotonic()
            await anyio.to_thread.run_sync(
                lambda: until(lambda: get(server, "/ready").status_code == 503, 2, "/ready 503")
            )
        [(text, error, ended)] = outcome
        assert ended - killed <= 2
        assert error is not None, text
        assert error.code == "engine_unavailable"
        lives = []

        def rebuilt() -> bool:
            lives.append(get(server, "/live").status_code)
            lives.append(get(server, "/metrics").status_code)  # (the scrape answers too)
            return get(server, "/ready").status_code == 200

        await anyio.to_thread.run_sync(lambda: until(rebuilt, 240, "rebuilt"))
        assert set(lives) == {200}  # alive all along
        assert await answer(client) == expected
        scraped = get(server, "/metrics").text
        assert f'llm_pipeline_engine_restarts_total{{model="{MODEL}"}} 1.0' in scraped
        assert f'llm_pipeline_engine_stalls_total{{model="{MODEL}"}} 1.0' in scraped

        # -- kill -9 past the budget (one restart): dead; the process drains, then exits 1
        started = anyio.Event()
        async with anyio.create_task_group() as tg:
            echoed: list[Outcome] = []

            async def echo_stream() -> None:  # (the other model: what the drain waits for)
                echoed.append(await stream_until_error(client, started, "echo", tokens=60))

            tg.start_soon(echo_stream)
            await started.wait()
            engine_core(server).kill()
            lives = []

            def dead() -> bool:
                lives.append(get(server, "/live"))
                return lives[-1].status_code == 503

            await anyio.to_thread.run_sync(lambda: until(dead, 5, "/live 503"))
            assert lives[-1].json()["status"] == "dead"
            assert server.process.poll() is None  # (the echo stream drains)
        [(text, error, _)] = echoed
        assert error is None, text  # it drained: the stream finished
        code = await anyio.to_thread.run_sync(lambda: server.process.wait(30))
        assert code == 1
    log = server.stderr()
    assert log.count("an engine is dead beyond recovery, exiting after the drain") == 1
    # (vLLM logs the death of its engine core with a traceback of its own, prefixed)
    assert not [line for line in log.splitlines() if line.startswith("Traceback")]
