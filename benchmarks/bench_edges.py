"""CPU-µs per token through each edge: chat completions, the Responses API, Messages.

Starts ``llm-pipeline serve --engine echo --echo-cycle`` and drives the same streamed
workload (``--prompt-tokens`` in, ``--max-tokens`` out) through each API with the load
generator (``benchmarks/loadgen.py``), in interleaved rounds so that the machine's noise
falls on every edge alike. Prints, per edge, the server's CPU time per output token
(median over the rounds), tokens/s, and the ratio to chat completions (the goal: within
10 %)::

    .venv/bin/python benchmarks/bench_edges.py --concurrency 16 --requests 400 --rounds 3

Responses are streamed with ``store: false`` (the store's own cost is
``benchmarks/bench_responses_store.py``'s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import loadgen

ROOT = Path(__file__).resolve().parents[1]
BANNER = re.compile(rb"on (http://\S+)")


def start_server(*options: str) -> tuple[subprocess.Popen[bytes], str]:
    """``llm-pipeline serve`` on a free port; (process, base URL)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "operators.cli", "serve", "--port", "0", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    match = BANNER.search(line)
    if match is None:
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return process, match.group(1).decode()


def run_loadgen(url: str, pid: int, api: str, args: argparse.Namespace) -> dict[str, object]:
    argv = [
        "--url", url, "--api", api, "--server-pid", str(pid),
        "--concurrency", str(args.concurrency), "--requests", str(args.requests),
        "--warmup", str(args.warmup), "--prompt-tokens", str(args.prompt_tokens),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    return asyncio.run(loadgen.main_async(loadgen.parse_args(argv)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--apis", default="chat,responses,messages")
    args = parser.parse_args()
    apis = args.apis.split(",")
    process, url = start_server("--engine", "echo", "--echo-cycle")
    cpu: dict[str, list[float]] = {api: [] for api in apis}
    rate: dict[str, list[float]] = {api: [] for api in apis}
    try:
        for round_number in range(args.rounds):
            for api in apis if round_number % 2 == 0 else apis[::-1]:
                report = run_loadgen(url, process.pid, api, args)
                if report["errors"]:
                    raise RuntimeError(f"{api}: {report['errors']} errors: {report['first_error']}")
                cpu[api].append(float(report["server_cpu_us_per_token"]))  # type: ignore[arg-type]
                rate[api].append(float(report["output_tokens_per_s"]))  # type: ignore[arg-type]
    finally:
        process.terminate()
        process.wait(30)
    print(
        f"echo engine, {args.prompt_tokens} -> {args.max_tokens} tokens, concurrency "
        f"{args.concurrency}, {args.requests} requests x {args.rounds} rounds per edge"
    )
    print(f"{'edge':<12}{'server CPU-µs/token':>22}{'tokens/s':>12}{'vs chat':>10}")
    base = statistics.median(cpu[apis[0]])
    for api in apis:
        median = statistics.median(cpu[api])
        runs = " ".join(f"{value:.1f}" for value in cpu[api])
        print(
            f"{api:<12}{median:>22.1f}{statistics.median(rate[api]):>12.0f}"
            f"{median / base - 1:>+10.1%}   (rounds: {runs})"
        )


if __name__ == "__main__":
    main()
