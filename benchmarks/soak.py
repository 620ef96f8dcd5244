"""A soak: thousands of mixed requests, clients that leave, bad bodies, one worker killed.

    python benchmarks/soak.py [--requests 10000] [--concurrency 32] [--kill-at 0.4]

Starts a ``nats-server``, two ``llm-pipeline worker --engine echo --echo-delay-ms 2``
processes and ``llm-pipeline serve --nats`` in front of them, then sends ``--requests``
requests from ``--concurrency`` clients, each drawn at random (seeded):

* streamed chat or completions (8-64 tokens, sometimes ``n=2`` or logprobs); a fifth of the
  streams are abandoned by their client after a few events;
* non-streamed chat or completions;
* bad bodies: broken JSON, invalid UTF-8, wrong types, unsupported features, hostile image
  URLs (each must be a 4xx);
* ``GET /v1/models`` and ``/health``.

When ``--kill-at`` of the requests have been sent, one worker is killed with SIGKILL
(Migration must move its streams to the other). Printed: requests by outcome, HTTP
statuses, errors by class (client exceptions and error events), the 5xx count, the
frontend's in-flight gauge at the end, its RSS and thread count before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from bench_nats_http import CLI, base_url, nats_server, process

BAD_BODIES: list[bytes] = [
    b"{", b"", b"null", b"[]", b'{"messages": "hi"}', b"\xff\xfe\x00",
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "n": "two"}',
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
    b'"function", "function": {"name": "f"}}]}',
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "response_format": '
    b'{"type": "json_object"}}',
    b'{"model": "echo", "messages": [{"role": "user", "content": [{"type": "image_url", '
    b'"image_url": {"url": "http://[::1"}}]}]}',
    b'{"model": "echo", "prompt": "hi", "max_tokens": -1}',
    b'{"model": "echo", "prompt": "hi", "temperature": 9}',
    b'{"model": "other", "prompt": "hi"}',
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
]  # fmt: skip


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (KiB) and Threads of ``pid``."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()


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
            response = await http.post(path, content=rng.choice(BAD_BODIES))
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
        async with http.stream("POST", path, json=body) as response:
            tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                await response.aread()
                tally.errors[f"{response.status_code} {response.json()['error']['type']}"] += 1
                tally.outcomes["stream refused"] += 1
                return
            events = 0
            last = ""
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line.removeprefix("data: ")
                events += 1
                if leave_after is not None and events >= leave_after:
                    tally.outcomes["stream abandoned by its client"] += 1
                    return
            if last == "[DONE]":
                tally.outcomes["stream complete"] += 1
            else:
                error = json.loads(last).get("error", {})
                tally.errors[f"event {error.get('type')}: {error.get('message', '')[:60]}"] += 1
                tally.outcomes["stream ended by an error event"] += 1
    except httpx.HTTPError as exc:
        tally.errors[f"client {type(exc).__name__}"] += 1
        tally.outcomes["client exception"] += 1


async def drive(url: str, args: argparse.Namespace, kill: Any) -> Tally:
    tally = Tally()
    rng = random.Random(args.seed)
    sent = 0
    kill_at = int(args.requests * args.kill_at)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

        async def client() -> None:
            nonlocal sent
            while sent < args.requests:
                sent += 1
                if sent == kill_at:
                    kill()
                await one(http, random.Random(rng.random()), tally)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return tally


def inflight(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("llm_pipeline_inflight_requests "):
            return float(line.split()[1])
    raise RuntimeError("no in-flight gauge in /metrics")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kill-at", type=float, default=0.4, help="fraction sent before")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    echo = ["--engine", "echo", "--echo-delay-ms", "2"]
    with nats_server() as (_, nats_url), ExitStack() as stack:
        workers = [
            stack.enter_context(process(
                [*CLI, "worker", "--nats", nats_url, *echo, "--worker-id", f"soak-{i}"],
                ready="serving",
            ))[0]
            for i in range(2)
        ]  # fmt: skip
        pid, line = stack.enter_context(
            process([*CLI, "serve", "--port", "0", "--nats", nats_url], ready="serving")
        )
        url = base_url(line).removesuffix("/v1")
        time.sleep(0.5)  # discovery
        httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=30)
        before = proc_status(pid)
        killed: list[float] = []

        def kill() -> None:
            os.kill(workers[0], signal.SIGKILL)
            killed.append(time.monotonic())

        started = time.monotonic()
        tally = asyncio.run(drive(url, args, kill))
        elapsed = time.monotonic() - started
        time.sleep(0.5)
        after = proc_status(pid)
        left = inflight(url)
    print(f"{args.requests} requests, concurrency {args.concurrency}, {elapsed:.1f} s, "
          f"worker killed: {bool(killed)}, {os.cpu_count()} CPUs")  # fmt: skip
    print("outcomes:", dict(tally.outcomes.most_common()))
    print("HTTP statuses:", dict(sorted(tally.statuses.items())))
    print("errors by class:", dict(tally.errors.most_common()) or "none")
    print("5xx responses:", sum(n for status, n in tally.statuses.items() if status >= 500))
    print("in flight at the end:", left)
    print(f"frontend RSS {before['VmRSS'] / 1024:.1f} -> {after['VmRSS'] / 1024:.1f} MiB, "
          f"threads {before['Threads']} -> {after['Threads']}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
