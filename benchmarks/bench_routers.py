"""Routers side by side on one trace (issue 37): ours, vllm-router 0.1.17, Dynamo's KV router.

    python benchmarks/bench_routers.py --scenario multiturn \\
        --routers ours-kv,ours-round-robin,vllm-cache_aware,vllm-power_of_two \\
        [--upstreams 4 | --vllm URL[,kv=tcp://HOST:PORT] ...] [--replayer ours|aiperf|both] \\
        [--scale 1] [--runs 1] [--json results.json]

For each router, in turn (``--runs`` rounds, the routers taking turns within a round):

1. the upstreams, fresh: ``--upstreams N`` starts N ``serve --engine mocker`` servers (their
   prefix caches empty; ``--mocker-*`` their timing), or ``--vllm URL`` names running vLLM
   servers (then every run's prompts get new hash ids, ``--id-offset``, so no run finds an
   earlier run's blocks cached);
2. the router in front of them: ``ours-POLICY`` is ``serve --engine remote --upstream ...
   --router POLICY`` (``kv``, ``round-robin``, ``least-loaded``; vLLM upstreams' ``kv=``
   endpoints are passed on); ``vllm-POLICY`` is ``vllm-router --policy POLICY``
   (``cache_aware``, ``power_of_two``, ``kv_aware`` with ``--kv-event-source`` from the
   ``kv=`` endpoints, so only over vLLM upstreams); ``dynamo-kv`` / ``dynamo-round-robin`` is
   ``dynamo_kv_stack.sh`` (Dynamo's frontend over its own four mockers: the same trace, not
   the same upstreams);
3. the trace (``router_trace.py``) replayed by ``trace_replay.py`` (ours) and/or ``aiperf
   profile --custom-dataset-type mooncake_trace --fixed-schedule`` (``--replayer``);
4. measured: TTFT p50/p99 (each replayer's), the upstreams' cached prompt tokens and
   requests (their ``/metrics``, diffed: ``llm_pipeline_cached_prompt_tokens_total`` and
   ``llm_pipeline_requests_total`` for our mockers, ``vllm:prefix_cache_hits_total`` and
   ``vllm:request_success_total`` for vLLM), the busiest upstream's share of the requests
   (over the mean), and the router's CPU time per request (``/proc/PID/stat``).

Everything started is stopped by its pid. Run it on an idle machine for numbers; ``--scale
0.1`` is a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from bench_kv_http import scrape
from loadgen import cpu_seconds
from router_trace import SCENARIOS, trace
from trace_replay import replay, summary

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VLLM_ROUTER = os.environ.get("VLLM_ROUTER", "/work/scratch/tools/router/bin/vllm-router")
AIPERF = os.environ.get("AIPERF", "/work/scratch/tools/aiperf/bin/aiperf")
TOKENIZER_DIR = ROOT / "operators" / "data" / "smollm2"
MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(argv: Sequence[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    """A process of ours (its output in ``log``), in a session of its own."""
    return subprocess.Popen(
        argv,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **env},
        start_new_session=True,
    )


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop ``process`` (and its group: vLLM-style children) by its pid."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


def wait_ready(url: str, what: str, timeout: float = 120.0, model: str = MODEL) -> None:
    """Until ``url`` completes a one-token request."""
    deadline = time.monotonic() + timeout
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} at {url} did not come up within {timeout:g}s")


def mocker_upstreams(count: int, args: argparse.Namespace, logs: Path) -> Iterator[Any]:
    """``count`` mocker servers; yields their URLs and processes."""
    processes, urls = [], []
    for n in range(count):
        port = free_port()
        argv = [sys.executable, "-m", "operators.cli", "serve", "--engine", "mocker",
                "--model-name", MODEL, "--port", str(port), "--no-ui",
                "--mocker-cache-blocks", str(args.mocker_cache_blocks),
                "--mocker-prefill-ms-per-token", str(args.mocker_prefill_ms),
                "--mocker-decode-ms-per-step", str(args.mocker_decode_ms),
                "--mocker-max-batch", str(args.mocker_max_batch)]  # fmt: skip
        processes.append(start(argv, logs / f"upstream-{n}.log", PYTHONPATH=str(ROOT)))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url in urls:
            wait_ready(url, "an upstream")
        yield urls
    finally:
        for process in processes:
            stop(process)


def router_process(
    name: str, upstreams: Sequence[str], kv: Sequence[str | None], logs: Path, port: int
) -> subprocess.Popen[bytes] | None:
    """The router ``name`` on ``port`` (None: Dynamo's, started by its script)."""
    kind, _, policy = name.partition("-")
    if kind == "ours":
        argv = [sys.executable, "-m", "operators.cli", "serve", "--engine", "remote",
                "--router", policy, "--port", str(port), "--no-ui", "--model-name", MODEL,
                "--upstream-poll-ms", "100", "--worker-wait", "30"]  # fmt: skip
        for url, endpoint in zip(upstreams, kv, strict=True):
            argv += ["--upstream", url if endpoint is None else f"{url},kv={endpoint}"]
        return start(argv, logs / f"{name}.log", PYTHONPATH=str(ROOT))
    if kind == "vllm":
        argv = [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *upstreams]  # fmt: skip
        if policy == "kv_aware":
            sources = [f"{u}={e}" for u, e in zip(upstreams, kv, strict=True) if e is not None]
            if not sources:
                raise SystemExit("vllm-kv_aware needs vLLM upstreams with kv= endpoints")
            for source in sources:
                argv += ["--kv-event-source", source]
            argv += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
        return start(argv, logs / f"{name}.log")
    if kind == "dynamo":
        mode = policy or "kv"
        script = HERE / "dynamo_kv_stack.sh"
        env = {**os.environ, "PORT": str(port), "MODEL": MODEL}
        subprocess.run([str(script), "start", mode], check=True, env=env)
        return None
    raise SystemExit(f"unknown router {name!r}: ours-POLICY, vllm-POLICY or dynamo-MODE")


def router_pids(process: subprocess.Popen[bytes] | None) -> list[int]:
    """The router's processes (Dynamo's frontend: the first pid its script wrote)."""
    if process is not None:
        return [process.pid]
    pids = Path(os.environ.get("ROOT", "/tmp/bench/dynamo")) / "kv_stack.pids"
    return [int(pids.read_text().split()[0])] if pids.exists() else []


def upstream_counts(urls: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Per upstream: (requests served, prompt tokens found cached), from its /metrics."""
    found: dict[str, tuple[float, float]] = {}
    with httpx.Client(timeout=10) as client:
        for url in urls:
            samples = scrape(client, [f"{url}/metrics"])
            requests = cached = 0.0
            for key, value in samples.items():
                name = key.split("|", 1)[1]
                if name.startswith("llm_pipeline_requests_total{") and "/v1/" in name:
                    requests += value if '"/v1/models"' not in name else 0.0
                elif name.startswith("vllm:request_success_total"):
                    requests += value
                elif name.startswith(("llm_pipeline_cached_prompt_tokens_total",
                                      "vllm:prefix_cache_hits_total")):  # fmt: skip
                    cached += value
            found[url] = (requests, cached)
    return found


def aiperf(url: str, trace_file: Path, out: Path, streaming: bool = True) -> dict[str, Any]:
    """aiperf's replay of ``trace_file``: TTFT p50/p99 from its JSON export."""
    argv = [AIPERF, "profile", "--model", MODEL, "--url", url, "--endpoint-type",
            "completions", "--input-file", str(trace_file), "--custom-dataset-type",
            "mooncake_trace", "--fixed-schedule", "--tokenizer", str(TOKENIZER_DIR),
            "--artifact-dir", str(out), "--ui", "none"]  # fmt: skip
    if streaming:
        argv.append("--streaming")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    exports = sorted(out.rglob("profile_export_aiperf.json"))
    if done.returncode != 0 or not exports:
        return {"error": (done.stderr or done.stdout)[-500:]}
    metrics = json.loads(exports[-1].read_text())
    ttft = metrics.get("time_to_first_token") or metrics.get("metrics", {}).get(
        "time_to_first_token", {}
    )
    return {
        "ttft_ms": {50: ttft.get("p50"), 99: ttft.get("p99")},
        "requests": (metrics.get("request_count") or {}).get("avg"),
    }


def run_one(
    name: str, args: argparse.Namespace, lines: list[dict[str, Any]], logs: Path, offset: int
) -> dict[str, Any]:
    """One router over fresh upstreams (or the running vLLMs), the trace replayed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        if name.startswith("dynamo"):
            upstreams: list[str] = []
            kv: list[str | None] = []
        elif args.vllm:
            upstreams = [spec.split(",", 1)[0] for spec in args.vllm]
            kv = [spec.split("kv=", 1)[1] if "kv=" in spec else None for spec in args.vllm]
        else:
            upstreams = stack.enter_context(
                contextlib.contextmanager(mocker_upstreams)(args.upstreams, args, logs)
            )
            kv = [None] * len(upstreams)
        process = router_process(name, upstreams, kv, logs, port)
        if process is not None:
            stack.callback(stop, process)
        else:
            stack.callback(subprocess.run, [str(HERE / "dynamo_kv_stack.sh"), "stop"], check=False)
        wait_ready(url, name)
        pids = router_pids(process)
        result: dict[str, Any] = {"router": name, "scenario": args.scenario}
        replayers = ["ours", "aiperf"] if args.replayer == "both" else [args.replayer]
        for replayer in replayers:
            before_counts = upstream_counts(upstreams)
            before_cpu = sum(cpu_seconds(pid) for pid in pids)
            if replayer == "ours":
                results, elapsed = asyncio.run(
                    replay(url, MODEL, lines, speedup=args.speedup, offset=offset)
                )
                measured = summary(results, elapsed)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    shifted = Path(tmp) / "trace.jsonl"
                    shifted.write_text("".join(
                        json.dumps({**line, "hash_ids": [b + offset for b in line["hash_ids"]]})
                        + "\n" for line in lines))  # fmt: skip
                    measured = aiperf(url, shifted, Path(tmp) / "artifacts")
            cpu = sum(cpu_seconds(pid) for pid in pids) - before_cpu
            after_counts = upstream_counts(upstreams)
            served = {u: after_counts[u][0] - before_counts[u][0] for u in upstreams}
            cached = sum(after_counts[u][1] - before_counts[u][1] for u in upstreams)
            total = sum(served.values())
            measured["upstream_requests"] = served
            measured["upstream_cached_tokens"] = cached if upstreams else None
            measured["busiest_share"] = (
                round(max(served.values()) / (total / len(served)), 2) if total else None
            )
            measured["router_cpu_ms_per_request"] = round(cpu * 1e3 / max(len(lines), 1), 3)
            result[replayer] = measured
            offset += 10_000_000  # the next replay's prompts are new to every cache
        return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--routers", default="ours-kv,ours-round-robin,vllm-cache_aware,"
                        "vllm-power_of_two")  # fmt: skip
    parser.add_argument("--upstreams", type=int, default=4, help="mocker servers to start")
    parser.add_argument("--vllm", action="append", default=[], metavar="URL[,kv=tcp://H:P]",
                        help="running vLLM servers instead (repeatable)")  # fmt: skip
    parser.add_argument("--replayer", choices=["ours", "aiperf", "both"], default="ours")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mocker-cache-blocks", type=int, default=16384)
    parser.add_argument("--mocker-prefill-ms", type=float, default=0.05)
    parser.add_argument("--mocker-decode-ms", type=float, default=10.0)
    parser.add_argument("--mocker-max-batch", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="append each result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lines = trace(args.scenario, seed=args.seed, scale=args.scale)
    logs = Path(tempfile.mkdtemp(prefix="bench-routers-"))
    offset = 0
    for run in range(args.runs):
        for name in args.routers.split(","):
            result = run_one(name, args, lines, logs, offset)
            result["run"] = run
            offset += 100_000_000
            print(json.dumps(result), flush=True)
            if args.json is not None:
                with args.json.open("a") as out:
                    out.write(json.dumps(result) + "\n")
    print(f"logs in {logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
