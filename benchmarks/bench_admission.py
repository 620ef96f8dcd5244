"""What a key's terms cost: the admission path's server CPU per token, and the shared
limits' round trip over NATS.

1. CPU-µs per token of ``llm-pipeline serve --engine echo --echo-cycle`` under the load
   generator (``benchmarks/loadgen.py``, streamed chat, ``--concurrency`` 64 by default)
   with no keys file, and with ``--api-keys`` holding ``--keys`` (100) keys, each with a
   requests, tokens and in-flight limit too high to refuse anything, the workers taking
   turns with the keys; rounds interleaved, medians printed. The difference is what
   admission, settlement and the usage counts cost (the goal: at most 1 µs per token)::

       .venv/bin/python benchmarks/bench_admission.py --concurrency 64 --requests 640 --rounds 3

2. With ``--nats``, the round trip of the shared budgets
   (:class:`operators.edges.http.nats_budgets.NatsBudgets`) in process, against a local
   nats-server: a take and a give (what one request costs: the settlement's give also
   carries the head's reservation in a busy key's batch) for one client at a time, and
   per request with ``--concurrency`` takes racing on one key from two frontends (their
   batches shared)::

       .venv/bin/python benchmarks/bench_admission.py --nats --requests 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_edges import start_server
from bench_nats_http import nats_server


def keys_file(directory: Path, count: int) -> tuple[Path, list[str]]:
    """A keys file of ``count`` keys with limits nothing here reaches; (its path, the keys)."""
    keys = [f"sk-bench-{number:04d}" for number in range(count)]
    tables = [
        f'[[key]]\nname = "k{number}"\nkey = "{key}"\nrequests_per_minute = 100000000\n'
        f"tokens_per_minute = 1000000000000\nmax_inflight = 100000\n"
        for number, key in enumerate(keys)
    ]
    path = directory / "keys.toml"
    path.write_text("\n".join(tables))
    return path, keys


def serve_round(args: argparse.Namespace, keys: Path | None, api_keys: list[str]) -> dict[str, Any]:
    options = ["--engine", "echo", "--echo-cycle", "--no-ui"]
    if keys is not None:
        options += ["--api-keys", str(keys)]
    process, url = start_server(*options)
    try:
        return run_loadgen_with_keys(url, process.pid, args, api_keys)
    finally:
        process.terminate()
        process.wait(15)
        if process.stdout is not None:
            process.stdout.close()


def run_loadgen_with_keys(
    url: str, pid: int, args: argparse.Namespace, api_keys: list[str]
) -> dict[str, Any]:
    import loadgen

    argv = [
        "--url", url, "--api", "chat", "--server-pid", str(pid),
        "--concurrency", str(args.concurrency), "--requests", str(args.requests),
        "--warmup", str(args.warmup), "--prompt-tokens", str(args.prompt_tokens),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    for key in api_keys:
        argv += ["--api-key", key]
    report: dict[str, Any] = asyncio.run(loadgen.main_async(loadgen.parse_args(argv)))
    return report


def cpu_per_token(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path, keys = keys_file(Path(directory), args.keys)
        rows: dict[str, list[float]] = {"no keys": [], f"{args.keys} keys": []}
        for _ in range(args.rounds):
            for label, file, api_keys in (("no keys", None, []), (f"{args.keys} keys", path, keys)):
                report = serve_round(args, file, api_keys)
                errors = report.get("errors") or 0
                if errors:
                    raise RuntimeError(f"{label}: {errors} requests failed: {report}")
                rows[label].append(float(report["server_cpu_us_per_token"]))
    base = statistics.median(rows["no keys"])
    for label, values in rows.items():
        median = statistics.median(values)
        print(
            f"{label:>10}: server CPU {median:6.2f} µs/token (runs {values}), +{median - base:.2f}"
        )


async def nats_round_trips(args: argparse.Namespace) -> None:
    import nats

    from operators.edges.http.limits import Ask, Limits
    from operators.edges.http.nats_budgets import NatsBudgets
    from operators.edges.http.tenants import Tenant

    with nats_server() as (_, url):
        clients = [await nats.connect(url) for _ in range(2)]
        try:
            budgets = [await NatsBudgets.open(nc) for nc in clients]
            key = Tenant(
                name="bench",
                digest=b"b",
                limits=Limits(10**9, 10**12, 10**6),
            )
            ask = Ask(requests=1, tokens=300, inflight=1)
            back = Ask(tokens=100, inflight=1)
            one: list[float] = []
            racing: list[float] = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.requests):
                    await budgets[0].take(key, ask)
                    await budgets[0].give(key, back)
                one.append((time.perf_counter() - start) / args.requests * 1e6)

                async def client(number: int, count: int) -> None:
                    for _ in range(count):
                        await budgets[number % 2].take(key, ask)
                        await budgets[number % 2].give(key, back)

                start = time.perf_counter()
                per = max(1, args.requests // args.concurrency)
                await asyncio.gather(*(client(n, per) for n in range(args.concurrency)))
                racing.append((time.perf_counter() - start) / (per * args.concurrency) * 1e6)
            print(
                f"take + give, one at a time: {statistics.median(one):8.1f} µs per request "
                f"(runs {[round(v) for v in one]})"
            )
            runs = [round(v) for v in racing]
            print(
                f"take + give, {args.concurrency} racing on 2 frontends: "
                f"{statistics.median(racing):8.1f} µs per request (runs {runs})"
            )
        finally:
            for nc in clients:
                await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--keys", type=int, default=100, help="keys in the keys file")
    parser.add_argument("--nats", action="store_true", help="the shared limits' round trip instead")
    args = parser.parse_args()
    if args.nats:
        asyncio.run(nats_round_trips(args))
    else:
        cpu_per_token(args)


if __name__ == "__main__":
    main()
