"""Disaggregated against aggregated serving with the real model, over NATS, mixed prompts.

    .venv/bin/python -m benchmarks.bench_llama_disagg [--requests 24] [--concurrency 4] \\
        [--long-tokens 600] [--short-tokens 40] [--long-every 4] [--max-tokens 32] \\
        [--setups disagg aggregated aggregated-x2-kv] [--reps 2]

Every setup is real processes: a nats-server, ``llm-pipeline worker --engine llama``
processes and a ``serve --nats`` frontend, started fresh for each rep, with the official
streaming API driven over HTTP (httpx, closed loop, ``--concurrency`` clients):

- ``disagg``: one ``--role prefill`` and one ``--role decode`` worker (``--threads`` each);
- ``aggregated``: one aggregated worker (``--threads``);
- ``aggregated-x2-kv``: two aggregated workers behind ``--router kv``.

The load mixes long prompts (every ``--long-every``-th request, ``--long-tokens`` words)
with short ones; all answers are exactly ``--max-tokens`` tokens (``ignore_eos``). What
disaggregation should buy is the short requests' inter-token latency: a long prefill no
longer runs in the decode worker's steps. Printed per setup (medians over ``--reps``):
TTFT p50/p99 of short and long requests, ITL p50/p99 of all streamed gaps, output
tokens/s; for ``disagg`` also the KV transfers the decode worker logged (cells, bytes per
prompt token, milliseconds per transfer and per 1,000 tokens).

On a 2-core machine the workers share the cores: this measures the mechanism and its
costs, not the capacity a separate prefill machine would add.

It runs as a module from the repository's root (``-m``), which puts the root on the import
path: the nats-server is started by the tests' own helper, ``tests.helpers.nats_server``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

import httpx

from tests.helpers.nats_server import NatsServer

HERE = Path(__file__).resolve().parent

MODEL = "SmolLM2-135M-Instruct"
SECRET = "bench-secret"
_TRANSFER = re.compile(
    r"KV transfer \S+: (\d+) cells \((\d+) bytes\) pulled from \S+ in ([\d.]+) ms"
)
_READY = re.compile(r"serving model .* on (http://\S+)")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


class Process:
    """A CLI subprocess; its stdout and stderr go to a file."""

    def __init__(self, *argv: str) -> None:
        self.log: IO[bytes] = tempfile.TemporaryFile()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "operators.cli", *argv],
            stdout=self.log,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=HERE.parent,
        )

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_for(self, pattern: str, within: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + within
        while (found := re.search(pattern, self.text())) is None:
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"not ready ({pattern}): {self.text()[-2000:]}")
            time.sleep(0.1)
        return found

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self.log.close()


@contextmanager
def deployment(setup: str, args: argparse.Namespace) -> Iterator[tuple[str, dict[str, Process]]]:
    """The frontend's base URL and the workers of ``setup``."""
    with tempfile.TemporaryDirectory() as directory, ExitStack() as stack:
        nats = NatsServer(Path(directory))
        nats.start()
        stack.callback(nats.stop)
        roles = {
            "disagg": [("prefill-1", "prefill"), ("decode-1", "decode")],
            "aggregated": [("agg-1", "aggregated")],
            "aggregated-x2-kv": [("agg-1", "aggregated"), ("agg-2", "aggregated")],
        }[setup]
        threads = args.threads if len(roles) == 1 else max(args.threads // len(roles), 1)
        workers: dict[str, Process] = {}
        for worker_id, role in roles:
            worker = Process(
                "worker", "--nats", nats.url, "--engine", "llama", "--role", role,
                "--worker-id", worker_id, "--threads", str(threads), "--transfer-secret", SECRET,
                "--log-level", "info", "--n-ctx", str(args.n_ctx),
            )  # fmt: skip
            stack.callback(worker.stop)
            workers[worker_id] = worker
        router = ["--router", "kv"] if setup.endswith("-kv") else []
        frontend = Process(
            "serve", "--nats", nats.url, "--model-name", MODEL, "--port", "0",
            "--log-level", "info", *router,
        )  # fmt: skip
        stack.callback(frontend.stop)
        for worker_id, worker in workers.items():
            worker.wait_for(rf"llm-pipeline worker {worker_id} serving")
            frontend.wait_for(rf"worker {worker_id} joined")
        url = frontend.wait_for(_READY.pattern)[1]
        yield url, workers


def prompts(args: argparse.Namespace, rep: int) -> list[tuple[str, bool]]:
    """``--requests`` (question, long?) pairs, seeded per rep: no cache carries over."""
    rng = random.Random(rep)
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima".split()
    out = []
    for i in range(args.requests):
        long = i % args.long_every == 0
        count = args.long_tokens if long else args.short_tokens
        text = " ".join(rng.choice(words) for _ in range(count))
        out.append((f"Request {rep}-{i}. Summarize: {text}", long))
    return out


async def run(url: str, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    queue = list(enumerate(prompts(args, rep)))
    ttft: dict[bool, list[float]] = {True: [], False: []}
    gaps: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(question: str, long: bool) -> None:
            nonlocal tokens
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            start = time.perf_counter()
            last = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    chunk = json.loads(line[5:])
                    if not any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft[long].append(now - start)
                    else:
                        gaps.append(now - last)
                    last = now
                    tokens += 1

        async def client_loop() -> None:
            while queue:
                _, (question, long) = queue.pop(0)
                await one(question, long)

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "ttft_short_p50": percentile(ttft[False], 50) * 1000,
        "ttft_short_p99": percentile(ttft[False], 99) * 1000,
        "ttft_long_p50": percentile(ttft[True], 50) * 1000,
        "ttft_long_p99": percentile(ttft[True], 99) * 1000,
        "itl_p50": percentile(gaps, 50) * 1000,
        "itl_p99": percentile(gaps, 99) * 1000,
        "tokens_per_s": tokens / elapsed,
    }


def transfers(log: str) -> dict[str, float] | None:
    found = [tuple(map(float, match)) for match in _TRANSFER.findall(log)]
    if not found:
        return None
    cells = sum(c for c, _, _ in found)
    return {
        "transfers": len(found),
        "cells": cells,
        "bytes_per_token": sum(b for _, b, _ in found) / cells,
        "ms_per_transfer": statistics.median(ms for _, _, ms in found),
        "ms_per_1000_tokens": sum(ms for _, _, ms in found) / cells * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=["disagg", "aggregated", "aggregated-x2-kv"])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=600)
    parser.add_argument("--short-tokens", type=int, default=40)
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="split among the workers")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    print(
        f"{args.requests} requests, {args.concurrency} clients, every {args.long_every}th "
        f"~{args.long_tokens} words, the others ~{args.short_tokens}; {args.max_tokens} tokens "
        f"each; {args.threads} threads in all; medians of {args.reps} (a fresh deployment each)"
    )
    keys = ("ttft_short_p50", "ttft_short_p99", "ttft_long_p50", "ttft_long_p99", "itl_p50",
            "itl_p99", "tokens_per_s")  # fmt: skip
    print(f"{'setup':<18}" + "".join(f"{key:>16}" for key in keys))
    for setup in args.setups:
        results = []
        moved = []
        for rep in range(args.reps):
            with deployment(setup, args) as (url, workers):
                results.append(asyncio.run(run(url, args, rep)))
                if "decode-1" in workers:
                    moved.append(transfers(workers["decode-1"].text()))
        medians = {key: statistics.median(r[key] for r in results) for key in keys}
        print(f"{setup:<18}" + "".join(f"{medians[key]:>16.1f}" for key in keys), flush=True)
        for found in moved:
            print(f"{'':<18}KV transfers: {found}")


if __name__ == "__main__":
    main()
