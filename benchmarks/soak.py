"""A soak: thousands of mixed requests, clients that leave, bad bodies, and faults.

    python benchmarks/soak.py [--requests 10000] [--concurrency 32] [--outage 3] \\
        [--restart-at 0.2] [--kill-at 0.4] [--stop-at 0.6] [--stop-seconds 5] [--no-ui]

Starts a ``nats-server``, three ``llm-pipeline worker --engine echo --echo-delay-ms 2``
processes and ``llm-pipeline serve --nats`` in front of them (and, as the reference of what
every answer must be, the embedded ``serve --engine echo``), then sends ``--requests``
requests from ``--concurrency`` clients, each drawn at random (seeded):

* streamed chat or completions (8-64 tokens, sometimes ``n=2`` or logprobs); a fifth of the
  streams are abandoned by their client after a few events;
* non-streamed chat or completions;
* bad bodies: broken JSON, invalid UTF-8, wrong types, unsupported features, hostile image
  URLs, integers no engine can hold (each must be a 4xx);
* ``GET /v1/models`` and ``/health``.

The faults, each when its fraction of the requests has been sent: ``--restart-at``, the
nats-server is killed (SIGKILL) and started again ``--outage`` seconds later on the same
port and store; ``--kill-at``, worker 0 is killed (SIGKILL); ``--stop-at``, worker 1 is
stopped (SIGSTOP) for ``--stop-seconds``. A fraction of 0 skips that fault.

Printed: requests by outcome, HTTP statuses, errors by class, the 5xx count, the frontend's
in-flight gauge at the end; for each fault, the streams in flight when it hit, how many
completed with exactly the reference's text, how many ended with an error event (and
why), and the longest stall any of them saw; RSS, threads and open fds of every process
before and after. While it runs, a line of every process's RSS per 1,000 requests served
(``--rss-every``) and after each fault: memory that only grows shows as a climb that does
not level off. (The first ~2,000 requests add ~1 MiB that levels off: caches and pools
filling. RSS is a coarse gauge: memory freed inside a process stays resident, and a small
leak fills it before RSS moves; ``llm_pipeline_python_allocated_blocks`` on ``/metrics``
shows one, see ``tests/operators/cli/test_cli_memory.py``.)
``--no-ui`` runs the frontend without its web UI and span buffer: run it both ways to see
what the UI holds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_nats_http import CLI, base_url, process

BAD_BODIES: list[bytes] = [
    b"{", b"", b"null", b"[]", b'{"messages": "hi"}', b"\xff\xfe\x00",
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "n": "two"}',
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "response_format": '
    b'{"type": "json_object"}}',
    b'{"model": "echo", "messages": [{"role": "user", "content": [{"type": "image_url", '
    b'"image_url": {"url": "http://[::1"}}]}]}',
    b'{"model": "echo", "prompt": "hi", "max_tokens": -1}',
    b'{"model": "echo", "prompt": "hi", "max_tokens": 9223372036854775808}',
    b'{"model": "echo", "prompt": [1, 4294967296]}',
    b'{"model": "echo", "prompt": "hi", "temperature": 9}',
    b'{"model": "other", "prompt": "hi"}',
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
]  # fmt: skip


def proc_status(pid: int) -> dict[str, int]:
    """RSS (KiB), threads and open file descriptors of ``pid``."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = int(value.split()[0])
    fields["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return fields


@dataclass
class Stream:
    """One streamed request as its client saw it."""

    path: str
    body: dict[str, Any]
    started: float
    ended: float = 0.0
    longest_stall: float = 0.0
    stall_ended: float = 0.0  # when the longest stall ended (time.monotonic)
    request_id: str = ""
    texts: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    abandoned: bool = False


@dataclass
class Fault:
    name: str
    at: float = 0.0  # when it hit (time.monotonic)
    over: float = 0.0  # when it was undone (the server restarted, the worker continued)


class Memory:
    """Prints every process's RSS: each ``every`` requests served, and after each fault."""

    def __init__(self, processes: dict[str, int], every: int) -> None:
        self.processes = processes
        self.every = every
        self.served = 0

    def line(self, when: str) -> None:
        sizes = []
        for name, pid in self.processes.items():
            try:
                sizes.append(f"{name} {proc_status(pid)['VmRSS'] / 1024:.1f}")
            except (OSError, KeyError):  # gone, or a zombie (no VmRSS) until it is reaped
                sizes.append(f"{name} gone")
        print(f"RSS (MiB) after {when}: {', '.join(sizes)}", flush=True)

    def one_more(self) -> None:
        self.served += 1
        if self.every and self.served % self.every == 0:
            self.line(f"{self.served} requests")


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.streams: list[Stream] = []


def _generation(rng: random.Random, stream: bool) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"model": "echo", "max_tokens": rng.randint(8, 64), "stream": stream}
    body["stream_options"] = {"include_usage": True} if stream else None
    if chat:
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(20))
        body["messages"] = [{"role": "user", "content": words}]
        if rng.random() < 0.1:
            body["logprobs"], body["top_logprobs"] = True, 2
    else:
        body["prompt"] = " ".join(str(rng.randint(0, 999)) for _ in range(30))
        if rng.random() < 0.1:
            body["logprobs"] = 1
    body = {key: value for key, value in body.items() if value is not None}
    if rng.random() < 0.05:
        body["n"] = 2
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _texts(event: dict[str, Any], texts: dict[int, str]) -> None:
    for choice in event.get("choices", ()):
        delta = choice.get("delta")
        piece = (delta or {}).get("content") if delta is not None else choice.get("text")
        texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")


async def read_stream(http: httpx.AsyncClient, stream: Stream, leave_after: int | None) -> int:
    """Stream ``stream``'s request; its HTTP status."""
    async with http.stream("POST", stream.path, json=stream.body) as response:
        if response.status_code != 200:
            await response.aread()
            error = response.json()["error"]
            n = stream.body.get("n", 1)
            stream.error = f"{response.status_code} {error['type']}: {error['message'][:80]}" + (
                f" (n={n}: not migrated)" if n > 1 else ""
            )
            return response.status_code
        stream.request_id = response.headers.get("x-request-id", "")
        events, last = 0, stream.started  # (the wait for the first event is a stall too)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if now - last > stream.longest_stall:
                stream.longest_stall, stream.stall_ended = now - last, now
            last = now
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                n = stream.body.get("n", 1)
                stream.error = f"event {error.get('type')}: {error.get('message', '')[:80]}" + (
                    f" (n={n}: not migrated)" if n > 1 else ""
                )
                break
            _texts(event, stream.texts)
            events += 1
            if leave_after is not None and events >= leave_after:
                stream.abandoned = True
                break
        return 200


async def one(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices(["stream", "complete", "bad", "get"], weights=[55, 20, 15, 10])[0]
    try:
        if kind == "get":
            response = await http.get(rng.choice(["/v1/models", "/health"]))
            tally.statuses[response.status_code] += 1
            tally.outcomes["get"] += 1
            return
        if kind == "bad":
            path = rng.choice(["/v1/chat/completions", "/v1/completions"])
            response = await http.post(
                path, content=rng.choice(BAD_BODIES), headers={"content-type": "application/json"}
            )
            tally.statuses[response.status_code] += 1
            ok = 400 <= response.status_code < 500 and "error" in response.json()
            tally.outcomes["bad body refused" if ok else "bad body NOT refused"] += 1
            return
        path, body = _generation(rng, kind == "stream")
        if kind == "complete":
            response = await http.post(path, json=body)
            tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                error = response.json()["error"]
                tally.errors[
                    f"{response.status_code} {error['type']}: {error['message'][:70]}"
                ] += 1
            tally.outcomes["complete"] += 1
            return
        leave_after = rng.randint(1, 6) if rng.random() < 0.2 else None
        stream = Stream(path, body, started=time.monotonic())
        tally.streams.append(stream)
        tally.statuses[await read_stream(http, stream, leave_after)] += 1
        stream.ended = time.monotonic()
        if stream.abandoned:
            tally.outcomes["stream abandoned by its client"] += 1
        elif stream.error is None:
            tally.outcomes["stream complete"] += 1
        else:
            tally.errors[stream.error] += 1
            tally.outcomes["stream ended by an error"] += 1
    except httpx.HTTPError as exc:
        tally.errors[f"client {type(exc).__name__}"] += 1
        tally.outcomes["client exception"] += 1


async def drive(
    url: str, args: argparse.Namespace, triggers: dict[int, Any], memory: Memory
) -> Tally:
    tally = Tally()
    rng = random.Random(args.seed)
    sent = 0
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def client() -> None:
            nonlocal sent
            while sent < args.requests:
                sent += 1
                trigger = triggers.get(sent)
                if trigger is not None:
                    asyncio.get_running_loop().run_in_executor(None, trigger)
                await one(http, random.Random(rng.random()), tally)
                memory.one_more()

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return tally


async def references(url: str, streams: list[Stream]) -> list[dict[int, str] | None]:
    """What the embedded reference server answers each completed stream's request."""
    out: list[dict[int, str] | None] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for stream in streams:
            if stream.abandoned or stream.error is not None:
                out.append(None)
                continue
            want = Stream(stream.path, stream.body, started=0.0)
            await read_stream(http, want, None)
            out.append(want.texts)
    return out


def inflight(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("llm_pipeline_inflight_requests "):
            return float(line.split()[1])
    raise RuntimeError("no in-flight gauge in /metrics")


class Nats:
    """A nats-server on a fixed port and store, killed and started again by the soak."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.port = 0
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        binary = Path(sys.executable).parent / "nats-server"
        port = str(self.port) if self.port else "-1"
        self.popen = subprocess.Popen(
            [str(binary), "-a", "127.0.0.1", "-p", port, "-js", "-sd",
             f"{self.directory}/js", "--ports_file_dir", self.directory],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        ports = Path(self.directory) / f"nats-server_{self.popen.pid}.ports"
        deadline = time.monotonic() + 10
        while not (ports.exists() and ports.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server wrote no ports file")
            time.sleep(0.005)
        url: str = json.loads(ports.read_text())["nats"][0]
        self.port = int(url.rsplit(":", 1)[1])
        return url

    def kill(self) -> None:
        if self.popen is not None:
            self.popen.kill()
            self.popen.wait()

    def close(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)


def report_fault(fault: Fault, streams: list[Stream], wanted: list[dict[int, str] | None]) -> None:
    hit = [
        (stream, want)
        for stream, want in zip(streams, wanted, strict=True)
        if stream.started <= fault.at <= stream.ended and not stream.abandoned
    ]
    same = sum(want is not None and stream.texts == want for stream, want in hit)
    errors = collections.Counter(stream.error for stream, _ in hit if stream.error is not None)
    worst = max((stream for stream, _ in hit), key=lambda s: s.longest_stall, default=None)
    stall = worst.longest_stall if worst is not None else 0.0
    print(f"  {fault.name}: {len(hit)} streams in flight; {same} completed identically; "
          f"{sum(errors.values())} ended with an error {dict(errors) or ''}; "
          f"longest stall {stall:.2f} s")  # fmt: skip
    lasted = max(fault.over - fault.at, 0.0)  # (0: a fault that is not undone, a kill)
    if worst is not None and stall > 2 * max(lasted, 1.0):
        print(f"    (request {worst.request_id or '?'}: {worst.path} n={worst.body.get('n', 1)}, "
              f"stalled from {worst.stall_ended - stall - fault.at:+.2f} s to "
              f"{worst.stall_ended - fault.at:+.2f} s of the fault"
              + (f", which lasted {lasted:.2f} s)" if lasted else ")"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--restart-at", type=float, default=0.2, help="fraction sent before")
    parser.add_argument("--outage", type=float, default=3.0, help="seconds without nats-server")
    parser.add_argument("--kill-at", type=float, default=0.4, help="fraction sent before")
    parser.add_argument("--stop-at", type=float, default=0.6, help="fraction sent before")
    parser.add_argument("--stop-seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--logs", metavar="DIR", help="write each process's log there")
    parser.add_argument("--no-ui", action="store_true", help="the frontend without its web UI")
    parser.add_argument(
        "--rss-every", type=int, default=1_000, metavar="N", help="an RSS line per N served"
    )
    args = parser.parse_args()
    echo = ["--engine", "echo", "--echo-delay-ms", "2"]
    with tempfile.TemporaryDirectory() as directory, ExitStack() as stack:
        nats = Nats(directory)
        stack.callback(nats.close)
        nats_url = nats.start()
        workers = [
            stack.enter_context(process(
                [*CLI, "worker", "--nats", nats_url, *echo, "--worker-id", f"soak-{i}",
                 "--log-level", "info"],
                ready="serving", stderr=args.logs and f"{args.logs}/worker-{i}.log",
            ))[0]
            for i in range(3)
        ]  # fmt: skip
        ui = ["--no-ui"] if args.no_ui else []
        pid, line = stack.enter_context(
            process(
                [*CLI, "serve", "--port", "0", "--nats", nats_url, "--log-level", "info", *ui],
                ready="serving",
                stderr=args.logs and f"{args.logs}/frontend.log",
            )
        )
        _, reference = stack.enter_context(
            process([*CLI, "serve", "--port", "0", "--engine", "echo"], ready="serving")
        )
        url = base_url(line).removesuffix("/v1")
        time.sleep(0.5)  # discovery
        httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=30)
        processes = {"frontend": pid, **{f"worker {i}": w for i, w in enumerate(workers)}}
        before = {name: proc_status(p) for name, p in processes.items()}
        memory = Memory(processes, args.rss_every)
        memory.line(f"the warm-up (frontend {'without' if args.no_ui else 'with'} its UI)")
        faults: list[Fault] = []

        def restart() -> None:
            fault = Fault(f"nats-server killed, restarted {args.outage:g} s later")
            faults.append(fault)
            fault.at = time.monotonic()
            nats.kill()
            time.sleep(args.outage)
            nats.start()
            fault.over = time.monotonic()
            memory.line(fault.name)

        def kill() -> None:
            faults.append(Fault("worker 0 killed (SIGKILL)", at=time.monotonic()))
            os.kill(workers[0], signal.SIGKILL)
            memory.line("worker 0 killed (SIGKILL)")

        def stop() -> None:
            fault = Fault(f"worker 1 stopped (SIGSTOP) for {args.stop_seconds:g} s")
            faults.append(fault)
            fault.at = time.monotonic()
            os.kill(workers[1], signal.SIGSTOP)
            time.sleep(args.stop_seconds)
            os.kill(workers[1], signal.SIGCONT)
            fault.over = time.monotonic()
            memory.line(fault.name)

        triggers = {
            int(args.requests * at): action
            for at, action in ((args.restart_at, restart), (args.kill_at, kill),
                               (args.stop_at, stop))
            if at > 0
        }  # fmt: skip
        started = time.monotonic()
        tally = asyncio.run(drive(url, args, triggers, memory))
        elapsed = time.monotonic() - started
        time.sleep(1.0)
        after = {name: proc_status(p) for name, p in processes.items() if name != "worker 0"}
        left = inflight(url)
        wanted = asyncio.run(references(base_url(reference).removesuffix("/v1"), tally.streams))
    complete = [(s, w) for s, w in zip(tally.streams, wanted, strict=True) if w is not None]
    print(f"{args.requests} requests, concurrency {args.concurrency}, {elapsed:.1f} s, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print("outcomes:", dict(tally.outcomes.most_common()))
    print("HTTP statuses:", dict(sorted(tally.statuses.items())))
    print("errors by class:", dict(tally.errors.most_common()) or "none")
    print("5xx responses:", sum(n for status, n in tally.statuses.items() if status >= 500))
    print(f"completed streams identical to the reference: "
          f"{sum(s.texts == w for s, w in complete)} of {len(complete)}")  # fmt: skip
    print("in flight at the end:", left)
    print("faults:")
    for fault in faults:
        report_fault(fault, tally.streams, wanted)
    for name, was in before.items():
        now = after.get(name)
        if now is None:
            print(f"{name}: killed")
            continue
        rss = f"RSS {was['VmRSS'] / 1024:.1f} -> {now['VmRSS'] / 1024:.1f} MiB"
        print(f"{name}: {rss}, threads {was['Threads']} -> {now['Threads']}, "
              f"fds {was['fds']} -> {now['fds']}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
