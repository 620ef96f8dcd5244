"""Two (or more) versions or settings of the llama server, measured in alternation.

    python benchmarks/bench_llama_ab.py --loadgen-python PY \\
        --variant "before=/path/to/old/tree" --variant "after=.:--step-ms 60" \\
        [--variant "llama-server=llama-server:/path/to/llama-server:-np 4"] \\
        [--concurrency 1 4 8] [--reps 3] [--parallel 4]

On a shared machine a run's speed depends on what else runs: comparing a version measured
now with one measured ten minutes ago mostly measures the neighbours. So every variant's
server runs at once (idle while it is not loaded), and each concurrency is measured rep by
rep in turn: A, B, A, B, ... The spread of each variant's reps says how noisy it was.

A variant is ``LABEL=TREE[:OPTIONS]``: ``llm-pipeline serve --engine llama`` run from the
source tree TREE (``.``: this one; an old version is ``git archive COMMIT | tar -x -C
DIR``) with extra OPTIONS, or ``LABEL=llama-server:PATH[:OPTIONS]`` for llama.cpp's own
server (``-fa off --cache-ram 0``, as in ``bench_llama_http.py``). The load is
``bench_llama_http.py``'s: chat, ``--prompt-tokens`` prompts -> exactly ``--max-tokens``
tokens, temperature 0, closed loop. Printed per variant and concurrency: the median and
the range over reps of tokens/s, TTFT p99 and ITL p99 (and the medians of the p50s).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench_llama_http import SHARED, free_port, load, server, smollm2_gguf


def command(spec: str, args: argparse.Namespace, port: int) -> tuple[str, list[str], Path | None]:
    label, _, rest = spec.partition("=")
    source, _, options = rest.partition(":")
    if source == "llama-server":
        binary, _, options = options.partition(":")
        return (
            label,
            [
                binary, "-m", str(smollm2_gguf()), "-t", str(args.threads),
                "-c", str(args.ctx), "-fa", "off", "--port", str(port), "--host", "127.0.0.1",
                "--cache-ram", "0", *options.split(),
            ],
            None,
        )  # fmt: skip
    return (
        label,
        [
            sys.executable, "-m", "operators.cli", "serve", "--engine", "llama",
            "--threads", str(args.threads), "--parallel", str(args.parallel),
            "--port", str(port), "--host", "127.0.0.1", "--model-name", "smollm2",
            *options.split(),
        ],
        Path(source).resolve(),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=8192, help="llama-server -c")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--loadgen", type=Path, default=SHARED / "dynamo" / "loadgen.py")
    parser.add_argument("--loadgen-python", default=sys.executable)
    args = parser.parse_args()
    print(
        f"chat, {args.prompt_tokens}-token prompts -> {args.max_tokens} tokens, "
        f"{args.threads} threads, ours --parallel {args.parallel}, temperature 0, "
        f"{args.reps} reps in alternation, {os.cpu_count()} CPUs"
    )
    with contextlib.ExitStack() as stack:
        ports: dict[str, int] = {}
        for spec in args.variant:
            port = free_port()
            label, argv, cwd = command(spec, args, port)
            previous = Path.cwd()
            if cwd is not None:
                os.chdir(cwd)  # python -m finds the tree's packages first
            try:
                stack.enter_context(server(argv, port))
            finally:
                os.chdir(previous)
            ports[label] = port
        print(
            f"{'variant':<16} {'c':>3} {'tok/s (range)':>20} {'TTFT p50':>9} "
            f"{'TTFT p99 (range)':>20} {'ITL p50':>8} {'ITL p99 (range)':>20}"
        )
        for concurrency in args.concurrency:
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in ports}
            requests = max(args.min_requests, 2 * concurrency)
            for _ in range(args.reps):
                for label, port in ports.items():
                    runs[label].append(load(args, port, concurrency, requests))
            for label, found in runs.items():
                print(f"{label:<16} {concurrency:>3} " + summary(found), flush=True)


def summary(runs: list[dict[str, Any]]) -> str:
    def cell(key: str, digits: int) -> str:
        values = [float(run[key]) for run in runs]
        return (
            f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})"
        )

    median = {
        key: statistics.median(float(run[key]) for run in runs)
        for key in ("ttft_ms_p50", "itl_ms_p50")
    }
    return (
        f"{cell('output_tokens_per_s', 1):>20} {median['ttft_ms_p50']:>9.0f} "
        f"{cell('ttft_ms_p99', 0):>20} {median['itl_ms_p50']:>8.1f} {cell('itl_ms_p99', 1):>20}"
    )


if __name__ == "__main__":
    main()
