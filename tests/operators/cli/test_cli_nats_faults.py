"""The message bus's faults, with real processes: what clients see must not change.

A nats-server (killed with SIGKILL and restarted on the same port and store), ``serve
--nats`` and ``llm-pipeline worker`` subprocesses, driven over HTTP with the official
``openai`` client. Every stream is compared with the fault-free reference (the embedded
server, whose echo is deterministic), and each process's log with what an operator should
read: one line when the bus is lost and one when it is back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from tests.helpers.client_view import chat_stream
from tests.helpers.nats_server import server_binary
from tests.helpers.server_process import ServerProcess, run_cli
from tests.operators.cli.test_cli_nats import Deployment, client, load_requests, wait_until

pytestmark = pytest.mark.slow

#: 16 streams of ~55 tokens at 40 ms each (2.2 s) are all in flight when the fault hits
ECHO = ["--echo-delay-ms", "40"]
STREAMS = 16
#: longer than the client's idle ping (0.5 s) plus its timeout (1 s): without riding it
#: out, every stream would fail with "did not answer a liveness ping"
OUTAGE = 8.0


@pytest.fixture(scope="module")
def local_echo() -> Iterator[ServerProcess]:
    server = ServerProcess()
    yield server
    server.stop()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path)
    try:
        yield deployment
    finally:
        deployment.close()


async def _reference(server: ServerProcess, requests: list[dict[str, Any]]) -> list[Any]:
    async with client(server) as api:
        return [await chat_stream(api, **body) for body in requests]


async def _under_fault(
    deployment: Deployment, requests: list[dict[str, Any]], fault: Any
) -> tuple[list[Any], float]:
    """Run ``requests`` at once; once each has its first chunk, run ``fault()`` (in a
    thread) while they go on. What each got (or the exception it ended with), and the
    longest silence any stream saw (seconds)."""
    got: list[Any] = [None] * len(requests)
    started = [anyio.Event() for _ in requests]
    longest = 0.0

    async def run(api: openai.AsyncOpenAI, i: int) -> None:
        nonlocal longest
        stream = await api.chat.completions.create(
            model="echo", stream=True, stream_options={"include_usage": True}, **requests[i]
        )
        last = time.monotonic()
        text, finishes, usage, tokens = "", [], None, []
        try:
            async for chunk in stream:
                now = time.monotonic()
                longest, last = max(longest, now - last), now
                started[i].set()
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)
                    if choice.logprobs:
                        tokens += [
                            (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                            for t in choice.logprobs.content or []
                        ]
        except openai.APIError as exc:
            started[i].set()
            got[i] = exc
            return
        got[i] = {"text": text, "finishes": finishes, "usage": usage, "logprobs": tokens}

    async with client(deployment.server, timeout=60) as api:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(run, api, i)
                for event in started:
                    await event.wait()
                await anyio.to_thread.run_sync(fault)
    return got, longest


def _outage(deployment: Deployment, seconds: float) -> None:
    deployment.nats.kill()
    time.sleep(seconds)  # (in a thread: the streams go on meanwhile)
    deployment.nats.start()


async def _migrations(server: ServerProcess) -> float:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    match = re.search(r'^llm_pipeline_migrations_total\{kind="stream",outcome="retried"\} (\S+)$',
                      text, re.MULTILINE)  # fmt: skip
    return float(match[1]) if match else 0.0


@pytest.mark.time_limit(90)
async def test_a_bus_outage_shorter_than_the_deadline_is_ridden_out(
    deployment: Deployment, local_echo: ServerProcess
) -> None:
    # Once, every stream ended with "worker ... did not answer a liveness ping within 1s"
    # after a ~6 s stall: a frontend that had lost the bus took its workers for dead.
    requests = load_requests(STREAMS, stops=False)
    want = await _reference(local_echo, requests)
    deployment.start({"w1": ECHO, "w2": ECHO})
    got, longest = await _under_fault(deployment, requests, lambda: _outage(deployment, OUTAGE))
    assert got == want  # every stream, exactly the fault-free output, no error
    assert longest >= OUTAGE  # (the outage really stalled the streams)
    # Ridden out, not migrated: each stream ended on its worker during the outage, and
    # its worker kept the end for the client (a stream of n > 1 could not have migrated).
    assert await _migrations(deployment.server) == 0
    # The bus is back: a new request is served, by a worker that is still registered.
    async with client(deployment.server) as api:
        assert await chat_stream(api, **requests[0]) == want[0]
    # Each process says it once: lost, then back with the outage's length. Not one line
    # per reconnection attempt.
    logs = {"frontend": deployment.server.stderr()} | {
        worker_id: worker.stderr() for worker_id, worker in deployment.workers.items()
    }
    for name, log in logs.items():
        assert log.count("lost the NATS connection") == 1, (name, log)
        back = re.findall(r"the NATS connection is back after ([\d.]+)s", log)
        assert len(back) == 1, (name, log)
        assert float(back[0]) >= OUTAGE - 0.5
        assert "encountered error" not in log
        assert "Traceback" not in log


@pytest.mark.time_limit(60)
async def test_an_outage_past_the_deadline_ends_with_the_deadline_error(
    tmp_path: Path,
) -> None:
    deployment = Deployment(tmp_path)
    try:
        deployment.spawn("w1", *ECHO).wait_ready()
        deployment.frontend = ServerProcess(
            "--nats", deployment.nats.url, "--request-timeout", "3", "--log-level", "info"
        )
        deployment.wait_joined("w1")
        requests = load_requests(4, stops=False)
        got, _ = await _under_fault(deployment, requests, lambda: _outage(deployment, 6.0))
        for result in got:
            assert isinstance(result, openai.APIError)
            assert result.type == "timeout_error"  # the deadline's error, as without NATS
        async with client(deployment.server) as api:  # and the bus is back for new ones
            assert (await chat_stream(api, **requests[0]))["finishes"] == ["stop"]
    finally:
        deployment.close()


@pytest.mark.time_limit(60)
async def test_a_stopped_worker_is_noticed_and_its_streams_migrate(
    deployment: Deployment, local_echo: ServerProcess
) -> None:
    requests = load_requests(STREAMS, stops=False)
    want = await _reference(local_echo, requests)
    deployment.start({"w1": ["--echo-delay-ms", "20"], "w2": ["--echo-delay-ms", "20"]})
    stopped = deployment.workers["w2"]
    try:
        got, _ = await _under_fault(deployment, requests, lambda: stopped.signal(signal.SIGSTOP))
    finally:
        stopped.signal(signal.SIGCONT)
    assert got == want
    assert await _migrations(deployment.server) >= 1  # w2's streams moved to w1


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match[1])


@pytest.mark.time_limit(60)
async def test_a_slow_reader_keeps_memory_bounded_on_both_ends(deployment: Deployment) -> None:
    # The worker could produce this stream in a fraction of a second; the client reads
    # 200 kB and then stops reading for a while. Flow control stops the worker within a
    # window: neither process buffers what the client has not read.
    deployment.start({"fast": ["--echo-cycle"]})
    worker = deployment.workers["fast"].process.pid
    frontend = deployment.server.process.pid
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": "a long answer"}],
        "max_tokens": 400_000,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=deployment.server.base_url, timeout=30) as http,
        http.stream("POST", "/chat/completions", json=body) as response,
    ):
        read = 0
        async for chunk in response.aiter_bytes():
            read += len(chunk)
            if read > 200_000:
                break
        before = _rss_kib(worker), _rss_kib(frontend)
        await anyio.sleep(3)  # the client does not read: what would pile up, and where
        after = _rss_kib(worker), _rss_kib(frontend)
    # Unbounded, 3 s of a cycling echo is hundreds of thousands of outputs (~100 MB).
    assert after[0] - before[0] < 16_000, (before, after)
    assert after[1] - before[1] < 16_000, (before, after)


@pytest.mark.time_limit(60)
async def test_a_slow_worker_still_ends_at_the_request_timeout(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path)
    try:
        slow = deployment.spawn("slow", "--echo-delay-ms", "400").wait_ready()
        deployment.frontend = ServerProcess(
            "--nats", deployment.nats.url, "--request-timeout", "1.5", "--log-level", "info"
        )
        deployment.wait_joined("slow")
        async with client(deployment.server) as api:
            started = time.monotonic()
            with pytest.raises(openai.APIError) as info:
                await chat_stream(api, **load_requests(1, stops=False)[0])
            assert time.monotonic() - started < 10  # (not the 60 tokens' 24 s)
        assert info.value.type == "timeout_error"
        # The worker heard of it: the request is over there too, not left running.
        await wait_until(lambda: [how for _, how in slow.served()] == ["cancelled"], within=5)
    finally:
        deployment.close()


def _nats_server(directory: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A nats-server started with ``args``; its process and URL."""
    process = subprocess.Popen(
        [str(server_binary()), "-a", "127.0.0.1", "-p", "-1", "--ports_file_dir",
         str(directory), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ports = directory / f"nats-server_{process.pid}.ports"
    deadline = time.monotonic() + 10
    while not (ports.exists() and ports.read_text().strip()):
        assert time.monotonic() < deadline, "nats-server did not start"
        time.sleep(0.01)
    import json

    url = json.loads(ports.read_text())["nats"][0]
    return process, url


def _refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert any(all(word in line for word in words) for line in lines), result.stderr


def test_without_jetstream_serve_and_worker_say_so_at_start(tmp_path: Path) -> None:
    process, url = _nats_server(tmp_path)  # no -js
    try:
        for command in (["serve", "--nats", url], ["worker", "--nats", url]):
            _refused(run_cli([*command, "--port", "0"] if command[0] == "serve" else command,
                             timeout=30), "no JetStream", "-js")  # fmt: skip
    finally:
        process.kill()
        process.wait()


def test_a_bucket_that_cannot_be_created_or_written_is_said_at_start(tmp_path: Path) -> None:
    # A user who may not create the discovery bucket, nor write a key into it.
    config = tmp_path / "read-only.conf"
    config.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "authorization { users = [\n"
        "  {user: ro, password: ro, permissions: {publish: {deny: "
        '["$JS.API.STREAM.CREATE.>", "$KV.>"]}}}\n'
        "  {user: rw, password: rw}\n] }\n"
    )
    process, url = _nats_server(tmp_path, "-c", str(config))
    read_only = url.replace("nats://", "nats://ro:ro@")
    writer: subprocess.Popen[bytes] | None = None
    try:
        for command in (["serve", "--nats", read_only, "--port", "0"],
                        ["worker", "--nats", read_only]):  # fmt: skip
            _refused(run_cli(command, timeout=30), "llm-pipeline-workers", "permissions")
        # Once another user created it, a worker that may not write its key says that.
        writer = subprocess.Popen(
            [sys.executable, "-m", "operators.cli", "worker", "--worker-id", "writer",
             "--nats", url.replace("nats://", "nats://rw:rw@")],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert writer.stdout is not None
        assert b"serving model" in writer.stdout.readline()
        _refused(run_cli(["worker", "--nats", read_only], timeout=30), "register", "permissions")
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
            assert writer.stdout is not None
            writer.stdout.close()
        process.kill()
        process.wait()
