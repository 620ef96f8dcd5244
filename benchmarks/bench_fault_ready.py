"""How fast a fault is seen: from the fault to ``/ready`` 503, and to the first request
served elsewhere (or by the rebuilt engine), as medians over ``--reps`` faults of each kind.

    PYTHONPATH=. python benchmarks/bench_fault_ready.py [--reps 5] [--stall-timeout 1] \\
        [--vllm] [--only stall,stop,kill]

Each fault gets a fresh deployment (none survives its fault unchanged), started from the
repository's CLI with the test suite's process helpers:

* ``stall``: ``serve --engine mocker --freeze-after-tokens 30 --stall-timeout S``; a stream
  runs into the freeze (as under a hung GPU). Timed from the last token the client got:
  ``/ready`` 503 (polled every 10 ms), and the stream's end (its 503 error event). There
  is no elsewhere in one process: new requests get 503 at once.
* ``stop`` / ``kill``: a nats-server, two ``worker --engine echo --echo-delay-ms 20`` and
  ``serve --nats``; six streams in flight over both workers, then worker ``a`` gets SIGSTOP
  or SIGKILL. Timed from the signal: the streams that were on ``a`` resuming with a token
  from ``b`` (Migration; the slowest of them), and the frontend's discovery dropping ``a``
  (its log line). ``/ready`` must stay 200 throughout (``b`` serves): a 503 is reported.
* ``--vllm``: ``serve --engine vllm`` (SmolLM2, CPU build; one server, a minute to start),
  a stream in flight, kill -9 of its ``VLLM::EngineCore``. Timed from the kill: ``/ready``
  503, and the first request answered by the rebuilt engine (one is sent every 0.2 s).

Printed: a line per fault and repetition, then the medians. Numbers from a busy machine
are upper bounds: polling adds up to 10 ms, and every process shares its cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from tests.helpers.nats_server import NatsServer
from tests.helpers.server_process import ServerProcess
from tests.helpers.worker_process import WorkerProcess

#: seconds between polls of /ready and of the frontend's log
POLL = 0.01
#: the longest a repetition waits for what it measures
PATIENCE = 60.0
ECHO = ["--engine", "echo", "--echo-delay-ms", "20", "--echo-cycle"]
VLLM_MODEL = "SmolLM2-135M-Instruct"
#: measures that are counts, not times
COUNTS = frozenset({"streams on a", "streams failed"})


@dataclass
class Stream:
    """One streamed request: when each of its events came (``time.monotonic()``), how it
    ended."""

    times: list[float] = field(default_factory=list)
    error: str | None = None
    ended: float | None = None

    def first_after(self, moment: float) -> float | None:
        return next((t for t in self.times if t > moment), None)


async def stream(http: httpx.AsyncClient, body: dict[str, object], into: Stream) -> None:
    """Stream ``body`` as a chat completion, noting each event's arrival in ``into``."""
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                into.error = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    into.error = str(event["error"].get("code") or event["error"].get("type"))
                    return
                into.times.append(time.monotonic())
    except httpx.HTTPError as exc:
        into.error = type(exc).__name__
    finally:
        into.ended = time.monotonic()


@dataclass
class Watch:
    """What a poller saw of a server: when ``/ready`` first said 503, and when a line
    matching ``logged`` first appeared in its log."""

    ready_503: float | None = None
    logged_at: float | None = None


async def watch(
    server: ServerProcess, until: anyio.Event, seen: Watch, logged: Callable[[str], bool]
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as http:
        while not until.is_set():
            if seen.ready_503 is None and (await http.get("/ready")).status_code == 503:
                seen.ready_503 = time.monotonic()
            if seen.logged_at is None and logged(server.stderr()):
                seen.logged_at = time.monotonic()
            await anyio.sleep(POLL)


def chat(tokens: int, model: str | None = None) -> dict[str, object]:
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": tokens,
        "stream": True,
    }
    if model is not None:
        body["model"] = model
    return body


def since(moment: float, then: float | None) -> float | None:
    return None if then is None else then - moment


# ------------------------------------------------------------------------------ the faults


async def stall(args: argparse.Namespace) -> dict[str, float | None]:
    """The mocker freezes mid-stream: /ready 503 and the stream's end, from its last token."""
    server = ServerProcess(
        "--engine", "mocker", "--mocker-tokens", "random", "--freeze-after-tokens", "30",
        "--stall-timeout", str(args.stall_timeout), "--log-level", "info",
    )  # fmt: skip
    try:
        done, seen, one = anyio.Event(), Watch(), Stream()
        async with httpx.AsyncClient(base_url=server.url, timeout=PATIENCE) as http:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, server, done, seen, lambda log: False)
                with anyio.move_on_after(PATIENCE):
                    await stream(http, chat(200), one)
                    await until(lambda: seen.ready_503 is not None)
                done.set()
        if not one.times:
            raise RuntimeError(f"the stream got no token ({one.error})")
        frozen = one.times[-1]
        return {
            "ready 503": since(frozen, seen.ready_503),
            "stream ended (503)": since(frozen, one.ended) if one.error else None,
        }
    finally:
        server.stop()


async def nats_fault(args: argparse.Namespace, signum: signal.Signals) -> dict[str, float | None]:
    """Worker ``a`` stopped or killed under six streams: when its streams resume on ``b``,
    when the frontend drops it; /ready must stay 200."""
    with tempfile.TemporaryDirectory() as directory, contextlib.ExitStack() as stack:
        nats = NatsServer(Path(directory))
        nats.start()
        stack.callback(nats.stop)
        workers = {name: WorkerProcess(nats.url, name, *ECHO) for name in "ab"}
        for worker in workers.values():
            stack.callback(worker.stop)
        server = ServerProcess("--nats", nats.url, "--log-level", "info")
        stack.callback(server.stop)
        for name, worker in workers.items():
            worker.wait_ready()
            await until(lambda name=name: f"worker {name} joined" in server.stderr())
        streams = [Stream() for _ in range(6)]
        done, seen = anyio.Event(), Watch()

        def dropped(log: str) -> bool:
            return any(f"worker a {what}" in log for what in ("left", "lost", "is not ready"))

        async with httpx.AsyncClient(base_url=server.url, timeout=PATIENCE) as http:
            async with anyio.create_task_group() as tg:
                for one in streams:
                    tg.start_soon(stream, http, chat(300), one)
                    await anyio.sleep(0.05)  # (one at a time: the router spreads them)
                await until(lambda: all(len(s.times) >= 5 for s in streams))
                tg.start_soon(watch, server, done, seen, dropped)
                fault = time.monotonic()
                workers["a"].signal(signum)
                await until(lambda: all(s.ended is not None for s in streams))
                done.set()
        if signum == signal.SIGSTOP:
            workers["a"].signal(signal.SIGCONT)
        gaps = {i: since(fault, s.first_after(fault)) for i, s in enumerate(streams)}
        moved = [gap for gap in gaps.values() if gap is not None and gap > 0.1]
        failed = [s.error for s in streams if s.error is not None]
        return {
            "streams on a resumed on b": max(moved) if moved else None,
            "frontend dropped a": since(fault, seen.logged_at),
            "streams on a": float(len(moved)),
            "streams failed": float(len(failed)),
            "/ready 503 (must not)": since(fault, seen.ready_503),
        }


async def vllm_kill(server: ServerProcess) -> dict[str, float | None]:
    """kill -9 of the engine core: /ready 503, and the rebuilt engine's first answer."""
    import psutil  # (the test extra's; only --vllm needs it)

    core = next(
        child
        for child in psutil.Process(server.process.pid).children(recursive=True)
        if child.name().startswith("VLLM::EngineCore")
    )
    done, seen, one = anyio.Event(), Watch(), Stream()
    answered: float | None = None
    async with httpx.AsyncClient(base_url=server.url, timeout=PATIENCE) as http:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, http, chat(400, VLLM_MODEL), one)
            await until(lambda: len(one.times) >= 3)
            tg.start_soon(watch, server, done, seen, lambda log: False)
            fault = time.monotonic()
            core.kill()
            with anyio.move_on_after(PATIENCE * 3):
                while answered is None:
                    body = {"model": VLLM_MODEL, "prompt": "Hello", "max_tokens": 2}
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.post("/v1/completions", json=body)).status_code == 200:
                            answered = time.monotonic()
                            break
                    await anyio.sleep(0.2)
            done.set()
    return {
        "ready 503": since(fault, seen.ready_503),
        "stream ended": since(fault, one.ended) if one.error else None,
        "rebuilt engine answered": since(fault, answered),
    }


@contextlib.contextmanager
def vllm_server(reps: int) -> Iterator[ServerProcess]:
    with tempfile.TemporaryDirectory() as directory:
        models = Path(directory) / "models.toml"
        models.write_text(
            f'[[model]]\nname = "{VLLM_MODEL}"\nengine = "vllm"\nmax-model-len = 1024\n'
        )
        server = ServerProcess(
            "--models", str(models), "--stall-timeout", "5", "--engine-restarts", str(reps + 1),
            "--engine-restart-window", "3600", "--log-level", "info", startup_timeout=300,
        )  # fmt: skip
        try:
            yield server
        finally:
            server.stop()


async def until(condition: Callable[[], bool], within: float = PATIENCE) -> None:
    """Poll ``condition`` (other processes' state) until it holds."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - it changes in other processes
            await anyio.sleep(POLL)


# ------------------------------------------------------------------------------- the report


def report(name: str, runs: list[dict[str, float | None]]) -> None:
    """Each measure's median over ``runs`` (counts: each run's), and how often it never
    came."""
    print(f"{name}: medians of {len(runs)}")
    for key in runs[0]:
        values = [run[key] for run in runs if run[key] is not None]
        never = len(runs) - len(values)
        if key in COUNTS:
            shown = " ".join(str(int(value)) for value in values)
        elif values:
            shown = f"{statistics.median(values):.3f} s"
            shown += f" (never in {never} of {len(runs)})" if never else ""
        else:
            shown = "never"
        print(f"  {key:28} {shown}")


async def main(args: argparse.Namespace) -> None:
    faults: dict[str, Callable[[], Awaitable[dict[str, float | None]]]] = {
        "stall": lambda: stall(args),
        "stop": lambda: nats_fault(args, signal.SIGSTOP),
        "kill": lambda: nats_fault(args, signal.SIGKILL),
    }
    titles = {
        "stall": f"mocker frozen (--stall-timeout {args.stall_timeout:g})",
        "stop": "NATS worker SIGSTOP, a second one serving",
        "kill": "NATS worker SIGKILL, a second one serving",
    }
    for name in args.only.split(","):
        runs = []
        for rep in range(args.reps):
            run = await faults[name]()
            print(f"{name} #{rep + 1}: {run}", flush=True)
            runs.append(run)
        report(titles[name], runs)
    if args.vllm:
        with vllm_server(args.reps) as server:
            runs = []
            for rep in range(args.reps):
                run = await vllm_kill(server)
                print(f"vllm #{rep + 1}: {run}", flush=True)
                runs.append(run)
        report("vLLM EngineCore kill -9 in serve --engine vllm", runs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="faults of each kind")
    parser.add_argument("--stall-timeout", type=float, default=1.0, help="the mocker's, in s")
    parser.add_argument("--only", default="stall,stop,kill", help="which faults (comma list)")
    parser.add_argument("--vllm", action="store_true", help="also kill vLLM's EngineCore")
    arguments = parser.parse_args()
    if not set(arguments.only.split(",")) <= {"stall", "stop", "kill"}:
        parser.error("--only takes stall, stop and kill")
    sys.exit(anyio.run(main, arguments))
