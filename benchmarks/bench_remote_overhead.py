"""What the graph costs in front of one vLLM server (issue 37): TTFT added, CPU per token.

    python benchmarks/bench_remote_overhead.py --vllm http://127.0.0.1:8001 --vllm-pid PID \\
        --model SmolLM2-135M-Instruct [--rounds 3] [--requests 200] [--max-tokens 64]

Starts ``serve --engine remote --upstream URL`` in front of the running vLLM (``--vllm``,
``--vllm-pid`` its API server process: the one ``python -m vllm.entrypoints.openai.
api_server`` started; its engine core is another) and runs ``loadgen.py``'s workload
against each in turn, ``--rounds`` times:

- at concurrency 1 (latency): TTFT p50 direct and through the graph, the difference the
  graph adds (tokenizing, the template, the stop jail, the detokenizer, a second HTTP hop);
- at ``--concurrency`` (throughput): the CPU per output token of vLLM's API server when
  serving directly, and of our server when serving through (vLLM's API server then only
  passes token ids: its own CPU in that run is reported too).

Chat completions both ways (both render the same template; vLLM with its own, ours with
the model's). The goal the issue sets: TTFT p50 added <= 2 ms, ours <= 1/5 of vLLM's CPU
per token. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_routers import free_port, start, stop, wait_ready
from loadgen import main_async
from loadgen import parse_args as loadgen_args

HERE = Path(__file__).resolve().parent


def measure(url: str, model: str, pid: int, args: argparse.Namespace, concurrency: int) -> Any:
    argv = ["--url", url, "--model", model, "--chat", "--concurrency", str(concurrency),
            "--requests", str(args.requests), "--warmup", "8",
            "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
            "--server-pid", str(pid)]  # fmt: skip
    return asyncio.run(main_async(loadgen_args(argv)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True, help="the vLLM server's URL")
    parser.add_argument("--vllm-pid", type=int, required=True, help="its API server's pid")
    parser.add_argument("--model", required=True, help="the model name vLLM serves")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    port = free_port()
    front = f"http://127.0.0.1:{port}"
    logs = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    process = start(
        [
            sys.executable,
            "-m",
            "operators.cli",
            "serve",
            "--engine",
            "remote",
            "--upstream",
            args.vllm,
            "--port",
            str(port),
            "--no-ui",
        ],
        logs / "front.log",
        PYTHONPATH=str(HERE.parent),
    )
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(front, "our server", model=args.model)
        for _ in range(args.rounds):
            direct = measure(args.vllm, args.model, args.vllm_pid, args, 1)
            through = measure(front, args.model, process.pid, args, 1)
            direct_load = measure(args.vllm, args.model, args.vllm_pid, args, args.concurrency)
            through_load = measure(front, args.model, process.pid, args, args.concurrency)
            rows.append({
                "ttft_p50_ms_direct": direct["ttft_ms"][50],
                "ttft_p50_ms_through": through["ttft_ms"][50],
                "vllm_api_cpu_us_per_token": direct_load["server_cpu_us_per_token"],
                "ours_cpu_us_per_token": through_load["server_cpu_us_per_token"],
                "errors": sum(r["errors"] for r in (direct, through, direct_load, through_load)),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(process)
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    median["ttft_p50_ms_added"] = median["ttft_p50_ms_through"] - median["ttft_p50_ms_direct"]
    median["cpu_ratio"] = median["ours_cpu_us_per_token"] / median["vllm_api_cpu_us_per_token"]
    print(json.dumps({"median": median}))


if __name__ == "__main__":
    main()
