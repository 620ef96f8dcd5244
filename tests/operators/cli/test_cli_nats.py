"""``llm-pipeline serve --nats`` with ``llm-pipeline worker`` processes, end to end.

Every process is real: a nats-server (the transport tests' ``NatsServer``), the frontend and
its workers started as ``python -m operators.cli ...``, driven over HTTP with the official
``openai`` client. Each test compares what clients see with a fault-free reference: the
embedded in-process server (``serve`` without ``--nats``), whose echo and mocker engines
are deterministic, so remote, migrated or disaggregated streams must equal it exactly.
"""

from __future__ import annotations

import base64
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import httpx
import openai
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from tests.helpers.client_view import chat_once, chat_stream
from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

_READY = re.compile(
    r"llm-pipeline worker (?P<id>\S+) serving model '(?P<model>[^']*)' as (?P<role>\w+) "
    r"via (?P<url>nats://\S+)"
)
#: a short system prompt, so that echoed chats do not start with the template's long one
SYSTEM = {"role": "system", "content": "echo"}
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


class WorkerProcess:
    """One ``llm-pipeline worker`` subprocess; :meth:`wait_ready` reads its ready line."""

    def __init__(self, url: str, worker_id: str, *options: str) -> None:
        self.worker_id = worker_id
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "operators.cli",
                "worker",
                "--nats",
                url,
                "--worker-id",
                worker_id,
                "--log-level",
                "info",
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.ready_line = ""

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        """Wait for the ready line (printed once the worker is registered)."""
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise RuntimeError(f"worker not ready within {timeout}s: {self.stderr()}")
        self.ready_line = self.process.stdout.readline().decode()
        match = _READY.search(self.ready_line)
        if match is None or match["id"] != self.worker_id:
            raise RuntimeError(f"unexpected ready line {self.ready_line!r}: {self.stderr()}")
        return self

    def stderr(self) -> str:
        """Everything the worker logged so far."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def served(self) -> list[tuple[str, str]]:
        """(request id, how it ended) for every request the worker logged as over."""
        return re.findall(r"request (\S+) (finished|stopped|cancelled|failed)", self.stderr())

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float = 15.0) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Stop the worker however it takes, and release its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


class Deployment:
    """A nats-server, a ``serve --nats`` frontend and its workers; stopped by :meth:`close`."""

    def __init__(self, directory: Path) -> None:
        self.nats = NatsServer(directory)
        self.nats.start()
        self.workers: dict[str, WorkerProcess] = {}
        self.frontend: ServerProcess | None = None

    def start(self, workers: dict[str, list[str]]) -> Deployment:
        """Start the workers and the frontend together; wait until the frontend knows them."""
        spawned = [self.spawn(worker_id, *options) for worker_id, options in workers.items()]
        self.frontend = ServerProcess("--nats", self.nats.url, "--log-level", "info")
        for worker in spawned:
            worker.wait_ready()
            self.wait_joined(worker.worker_id)
        return self

    def spawn(self, worker_id: str, *options: str) -> WorkerProcess:
        """Start a worker (without waiting for it)."""
        worker = WorkerProcess(self.nats.url, worker_id, *options)
        self.workers[worker_id] = worker
        return worker

    def wait_joined(self, worker_id: str, within: float = 10.0) -> None:
        """Wait until the frontend's discovery has added ``worker_id``."""
        server = self.server
        wait_for(lambda: f"worker {worker_id} joined" in server.stderr(), within)

    @property
    def server(self) -> ServerProcess:
        assert self.frontend is not None
        return self.frontend

    def close(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        for worker in self.workers.values():
            worker.stop()
        self.nats.stop()


def wait_for(condition: Callable[[], bool], within: float) -> None:
    """Poll ``condition`` (about other processes) until it holds; fail after ``within`` s."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {within}s")
        time.sleep(0.02)


async def wait_until(condition: Callable[[], bool], within: float) -> None:
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - other processes, no event to wait on
            await anyio.sleep(0.02)


@pytest.fixture
def deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """A started deployment; ``request.param`` (indirect parametrization): its workers."""
    deployment = Deployment(tmp_path)
    try:
        deployment.start(request.param)
        yield deployment
    finally:
        deployment.close()


def workers(**options: list[str]) -> Any:
    """Parametrize ``deployment`` with workers ``id=[options]``."""
    return pytest.mark.parametrize("deployment", [options], indirect=True, ids=["workers"])


@pytest.fixture(scope="module")
def local_echo() -> Iterator[ServerProcess]:
    """The embedded default: the reference every echo deployment must equal."""
    server = ServerProcess()
    yield server
    server.stop()


MOCKER = ["--engine", "mocker", "--mocker-decode-ms-per-step", "0.2"]
SECRET = ["--transfer-secret", "shared-by-this-deployment"]
ECHO_DELAY = ["--echo-delay-ms", "15"]
#: long enough streams (60 tokens, 2.4 s) that all 32 have started before the first ends,
#: even on a loaded machine (at 15 ms, 0.9 s, a busy frontend started the last ones late)
SLOW_ECHO = ["--echo-delay-ms", "40"]


@pytest.fixture(scope="module")
def local_mocker() -> Iterator[ServerProcess]:
    """The embedded mocker, aggregated: the reference of the disaggregated deployment."""
    server = ServerProcess(*MOCKER)
    yield server
    server.stop()


# -- what a client sees -------------------------------------------------------------------


def client(server: ServerProcess, timeout: float = 10) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=timeout)


async def metric(server: ServerProcess, name: str) -> float:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match[1])


def chat(content: str, **options: Any) -> dict[str, Any]:
    return {"messages": [SYSTEM, {"role": "user", "content": content}], **options}


WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def load_requests(count: int, *, stops: bool = True) -> list[dict[str, Any]]:
    """``count`` distinct chats of ~55 echoed tokens, four kinds in turn.

    Stop strings span words 2-12 of the user's text (echoed tokens ~11-30), so a worker
    lost meanwhile is lost while the Backend withholds a partial match: one kind completes
    the stop after the migration, one turns out a false start (the withheld text is then
    released), one has logprobs and no stop, one stops at two words with logprobs. A worker
    sees a request that ends at a stop string as cancelled (the frontend's Backend closes
    the stream once it found the stop); ``stops=False`` leaves the strings out.
    """
    requests = []
    for i in range(count):
        words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(24)]
        span = " ".join(words[2:12])[1:]
        options: dict[str, Any] = {"max_tokens": 60}
        kind = i % 4
        if kind == 0:
            options["stop"] = [span, "never matched"]
        elif kind == 1:
            options["stop"] = [f"{span} nope"]
        elif kind == 2:
            options.update(logprobs=True, top_logprobs=2)
        else:
            options.update(stop=[f"{words[14]} {words[15][:2]}"], logprobs=True, top_logprobs=1)
        if not stops:
            options.pop("stop", None)
        requests.append(chat(f"{i}: " + " ".join(words), **options))
    return requests


# -- the tests ----------------------------------------------------------------------------

EQUALITY_REQUESTS = [
    chat("the quick brown fox jumps over the lazy dog", max_tokens=12),
    chat(
        "say ozzy osbourne twice: ozzy osbourne",
        max_tokens=40,
        stop=["bourne tw"],
        logprobs=True,
        top_logprobs=2,
    ),
    chat("héllo 🥳 你好 wörld", max_tokens=30),
    chat("stops on a token it never reaches", max_tokens=5, stop=["zzz"], logprobs=True),
]


@workers(**{"echo-a": [], "echo-b": []})
async def test_remote_workers_stream_exactly_like_the_embedded_server(
    deployment: Deployment, local_echo: ServerProcess
) -> None:
    async with client(local_echo) as local_api, client(deployment.server) as remote_api:
        for body in EQUALITY_REQUESTS:
            want_stream = await chat_stream(local_api, **body)
            want_once = await chat_once(local_api, **body)
            assert want_stream["finishes"]
            for _ in range(2):  # round-robin: once on each worker
                assert await chat_stream(remote_api, **body) == want_stream
                assert await chat_once(remote_api, **body) == want_once
    a, b = deployment.workers["echo-a"], deployment.workers["echo-b"]
    # (a request that ended at a stop string is logged once the worker saw the kill)
    await wait_until(lambda: (len(a.served()), len(b.served())) == (8, 8), within=2)


@workers(w1=SLOW_ECHO, w2=SLOW_ECHO, w3=SLOW_ECHO)
@pytest.mark.time_limit(30)
async def test_a_worker_killed_mid_stream_under_load_is_invisible(
    deployment: Deployment, local_echo: ServerProcess
) -> None:
    requests = load_requests(32)
    async with client(local_echo) as api:
        want = [await chat_stream(api, **body) for body in requests]
    got: list[dict[str, Any] | None] = [None] * len(requests)
    started = [anyio.Event() for _ in requests]
    done_before_kill = 0
    async with client(deployment.server, timeout=15) as api:

        async def run(i: int) -> None:
            got[i] = await chat_stream(api, started=started[i], **requests[i])

        with anyio.fail_after(15):  # a hung stream fails the test here
            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(run, i)
                for event in started:  # every stream has its first chunk: all are in flight
                    await event.wait()
                done_before_kill = sum(result is not None for result in got)
                deployment.workers["w2"].process.kill()
    assert done_before_kill < len(requests) // 2  # the kill really hit streams mid-flight
    assert got == want
    retried = 'llm_pipeline_migrations_total{kind="stream",outcome="retried"}'
    assert await metric(deployment.server, retried) >= 1


@workers(w1=ECHO_DELAY, w2=ECHO_DELAY)
async def test_workers_join_and_leave_while_traffic_flows(
    deployment: Deployment, local_echo: ServerProcess
) -> None:
    requests = load_requests(12, stops=False)
    async with client(local_echo) as api:
        want = [await chat_stream(api, **body) for body in requests]
    failures: list[BaseException] = []
    mismatches: list[int] = []
    done = anyio.Event()
    completed = 0
    async with client(deployment.server, timeout=8) as api:

        async def traffic(i: int) -> None:
            nonlocal completed
            while not done.is_set():
                try:
                    if await chat_stream(api, **requests[i]) != want[i]:
                        mismatches.append(i)
                except Exception as exc:
                    failures.append(exc)
                completed += 1

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(traffic, i)
            await anyio.sleep(0.3)
            # A third worker joins mid-load (started in a thread: traffic goes on meanwhile).
            joining = deployment.spawn("w3", *ECHO_DELAY)
            await anyio.to_thread.run_sync(joining.wait_ready)
            await anyio.to_thread.run_sync(deployment.wait_joined, "w3")
            await wait_until(lambda: len(joining.served()) >= 3, within=3)
            # One leaves: SIGTERM drains it, and it exits with code 0.
            leaving = deployment.workers["w1"]
            leaving.signal(signal.SIGTERM)
            code = await anyio.to_thread.run_sync(leaving.wait)
            before = completed
            await wait_until(lambda: completed >= before + len(requests), within=4)
            done.set()
    assert code == 0
    assert not failures
    assert not mismatches
    log = leaving.stderr()
    drained = re.search(r"SIGTERM: worker w1 deregisters and drains (\d+) requests", log)
    assert drained is not None
    assert int(drained[1]) >= 1  # it had streams in flight...
    assert {how for _, how in leaving.served()} == {"finished"}  # ...and none was cut off
    assert "Traceback" not in log


#: slow enough that the long requests outlive the drain and the short ones do not
DRAINED = ["--echo-delay-ms", "25", "--drain-timeout", "0.6"]


@pytest.mark.parametrize("cut", ["drain-timeout", "second-signal"])
@workers(w1=DRAINED, w2=DRAINED)
async def test_a_worker_sigtermed_under_load_is_invisible(
    deployment: Deployment, local_echo: ServerProcess, cut: str
) -> None:
    # Short requests (about 6 tokens) finish within the drain; long ones (60) outlive it
    # and are cut off: by the drain timeout, or at once by a second SIGTERM.
    requests = [
        {**body, "max_tokens": 60 if i % 4 < 2 else 6}  # each worker gets both kinds
        for i, body in enumerate(load_requests(12, stops=False))
    ]
    async with client(local_echo) as api:
        want = [await chat_stream(api, **body) for body in requests]
    got: list[dict[str, Any] | None] = [None] * len(requests)
    started = [anyio.Event() for _ in requests]
    leaving = deployment.workers["w1"]
    async with client(deployment.server, timeout=15) as api:

        async def run(i: int) -> None:
            got[i] = await chat_stream(api, started=started[i], **requests[i])

        with anyio.fail_after(15):  # a hung stream fails the test here
            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(run, i)
                for event in started:
                    await event.wait()
                leaving.signal(signal.SIGTERM)
                if cut == "second-signal":
                    await wait_until(lambda: "deregisters and drains" in leaving.stderr(), 3)
                    leaving.signal(signal.SIGTERM)
                code = await anyio.to_thread.run_sync(leaving.wait)
    assert got == want
    assert code == 0
    ended = {how for _, how in leaving.served()}
    if cut == "drain-timeout":
        assert ended == {"finished", "cancelled"}  # drained, and cut off
    else:
        assert "cancelled" in ended
    # Every stream cut off was migrated because the worker said so (its ERR frame), not
    # because the frontend found the silence at its idle ping.
    lost = re.findall(
        r"worker lost at \w+ after \d+ tokens \((.*?)\); retrying", deployment.server.stderr()
    )
    assert lost
    assert set(lost) == {"worker w1 shut down"}
    assert "Traceback" not in leaving.stderr()


@workers(slow=["--echo-delay-ms", "20", "--echo-cycle"])
async def test_a_client_that_goes_away_stops_its_worker(deployment: Deployment) -> None:
    server, worker = deployment.server, deployment.workers["slow"]
    body = {**chat("keep talking please", max_tokens=500), "model": "echo", "stream": True}
    async with httpx.AsyncClient(timeout=10) as http:
        async with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as resp:
            request_id = resp.headers["x-request-id"]
            events = 0
            async for line in resp.aiter_lines():
                events += line.startswith("data:")
                if events == 5:
                    break  # the client hangs up mid-stream
    await wait_until(lambda: (request_id, "cancelled") in worker.served(), within=3)
    line = re.search(
        rf"request {request_id} cancelled after (\d+) outputs \(in flight: (\d+)\)",
        worker.stderr(),
    )
    assert line is not None
    assert int(line[1]) < 100  # it stopped within a few tokens, not at 500
    assert int(line[2]) == 0
    with anyio.fail_after(2):
        while await metric(server, "llm_pipeline_inflight_requests") != 0:  # noqa: ASYNC110
            await anyio.sleep(0.02)


@workers(before=[])
async def test_clients_reconnect_and_discovery_resyncs_after_a_nats_restart(
    deployment: Deployment, local_echo: ServerProcess
) -> None:
    body = chat("after the restart", max_tokens=8)
    async with client(local_echo) as api:
        want = await chat_stream(api, **body)
    async with client(deployment.server, timeout=3) as api:
        assert await chat_stream(api, **body) == want
        await anyio.to_thread.run_sync(deployment.nats.restart)
        with anyio.fail_after(5):  # clients reconnect, the worker is found again
            while True:
                try:
                    if await chat_stream(api, **body) == want:
                        break
                except openai.APIError:
                    await anyio.sleep(0.1)
        # The frontend follows registrations made after the restart: a new worker gets
        # its share of the requests.
        joining = deployment.spawn("after")
        await anyio.to_thread.run_sync(joining.wait_ready)
        await anyio.to_thread.run_sync(deployment.wait_joined, "after")
        for _ in range(4):
            assert await chat_stream(api, **body) == want
    assert len(joining.served()) == 2


def image_part(data: bytes = PNG, mime: str = "image/png") -> dict[str, Any]:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


@workers(
    **{
        "prefill-1": [*MOCKER, *SECRET, "--role", "prefill"],
        "decode-1": [*MOCKER, *SECRET, "--role", "decode"],
        "encode-1": [*MOCKER, *SECRET, "--role", "encode"],
    }
)
async def test_disaggregated_roles_across_processes_answer_like_one_aggregated_server(
    deployment: Deployment, local_mocker: ServerProcess
) -> None:
    picture = [{"type": "text", "text": "what is in this picture?"}, image_part()]
    bodies = [
        {"messages": [{"role": "user", "content": picture}], "max_tokens": 20},
        {"messages": [{"role": "user", "content": "a longer one"}], "max_tokens": 24},
        {"messages": [{"role": "user", "content": "just one"}], "max_tokens": 1},
    ]
    bodies = [{**body, "model": "mocker"} for body in bodies]  # (the mocker's served name)
    async with client(local_mocker) as local_api, client(deployment.server) as remote_api:
        for body in bodies:
            want = await chat_stream(local_api, **body)
            assert await chat_stream(remote_api, **body) == want
            assert await chat_once(remote_api, **body) == await chat_once(local_api, **body)
    served = {worker_id: w.served() for worker_id, w in deployment.workers.items()}
    assert len(served["encode-1"]) == 2  # the picture, streamed and not
    assert len(served["prefill-1"]) == 6
    assert len(served["decode-1"]) == 4  # max_tokens=1 needs no decode
    assert {how for ended in served.values() for _, how in ended} == {"finished"}


@workers(
    **{
        "prefill-a": [*MOCKER, *SECRET, "--role", "prefill"],
        "prefill-b": [*MOCKER, *SECRET, "--role", "prefill"],
        "encode-a": [*MOCKER, *SECRET, "--role", "encode"],
        "encode-b": [*MOCKER, *SECRET, "--role", "encode"],
        "decode-1": [*MOCKER, *SECRET, "--role", "decode"],
    }
)
async def test_killed_prefill_and_encode_workers_are_evicted_at_the_first_no_responders(
    deployment: Deployment, local_mocker: ServerProcess
) -> None:
    picture = [{"type": "text", "text": "what is in this picture?"}, image_part()]
    bodies = [
        {"messages": [{"role": "user", "content": picture}], "max_tokens": 12},
        {"messages": [{"role": "user", "content": "a longer one"}], "max_tokens": 16},
    ] * 4
    bodies = [{**body, "model": "mocker"} for body in bodies]
    async with client(local_mocker) as api:
        want = [await chat_stream(api, **body) for body in bodies]
    for worker_id in ("prefill-a", "encode-a"):  # kill -9: their keys outlive the test
        deployment.workers[worker_id].process.kill()
        deployment.workers[worker_id].wait()
    async with client(deployment.server) as api:
        got = [await chat_stream(api, **body) for body in bodies]
    assert got == want
    log = deployment.server.stderr()
    # The plain round-robin routers met each dead worker once: evicted there, never again.
    for worker_id in ("prefill-a", "encode-a"):
        lost = re.findall(rf"worker {worker_id} lost: (.*)", log)
        assert lost == ["its request subject has no responders"]
    assert len(re.findall(r"encode worker failed", log)) <= 1  # inline encoding, once
    retried = 'llm_pipeline_migrations_total{kind="connect",outcome="retried"}'
    assert await metric(deployment.server, retried) <= 1
