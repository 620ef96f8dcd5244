"""Replay a Mooncake-format trace (``router_trace.py``) against an OpenAI-compatible server.

    python benchmarks/trace_replay.py --url http://127.0.0.1:8000 --model NAME \\
        --trace multiturn.jsonl [--speedup 1] [--server-pid PID ...] [--json]

Open loop, as ``aiperf --fixed-schedule`` replays it: each line is sent at its timestamp
(divided by ``--speedup``) whatever is still running, as a streamed completion of
``output_length`` tokens (``ignore_eos``, greedy) whose prompt is the line's hash ids as
text (:func:`router_trace.prompt_text`: one SmolLM2 token per word, a block's words a
function of its id, ``--id-offset`` added so that a second run does not find the first's
prompts cached). Each request has a connection of its own (``loadgen``'s raw HTTP/1.1
client: a few µs per token). Reported: requests, errors, TTFT p50/p99 (request written ->
first token), prompt and cached prompt tokens as the server's usage says, and with
``--server-pid`` the CPU time of those processes (a router, its children) per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench_kv_http import vocabulary
from loadgen import APIS, RequestResult, Worker, Workload, cpu_seconds, percentile, uvloop
from router_trace import prompt_text

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_JSON = ROOT / "operators" / "data" / "smollm2" / "tokenizer.json"


def workload(url: str, model: str, line: dict[str, Any], words: list[str], offset: int) -> Workload:
    """One request of the trace, ready to send."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    shifted = {**line, "hash_ids": [block + offset for block in line["hash_ids"]]}
    body = {
        "model": model,
        "prompt": prompt_text(shifted, words),
        "max_tokens": int(line["output_length"]),
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data = json.dumps(body).encode()
    api = APIS["completions"]
    payload = (
        b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
        b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
        % (api.path.encode(), host.encode(), port, len(data))
    ) + data
    return Workload(host, port, api.path, (payload,), api.markers, False, api)


async def replay(
    url: str, model: str, lines: list[dict[str, Any]], *, speedup: float, offset: int
) -> tuple[list[RequestResult], float]:
    """Every line sent at its time; the results (in the trace's order: the ``n``-th is
    the ``n``-th line's) and the seconds it took."""
    words = vocabulary(TOKENIZER_JSON)
    ready = [workload(url, model, line, words, offset) for line in lines]
    results = [RequestResult(error="not sent") for _ in lines]

    async def send(index: int, at: float, request: Workload, start: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        worker = Worker(request)
        try:
            await worker.connect()
        except OSError as exc:
            results[index] = RequestResult(error=f"connect: {exc}")
            return
        got: list[RequestResult] = []
        await worker.run([1], got)
        await worker.close()
        results[index] = got[0]

    start = time.perf_counter()
    await asyncio.gather(
        *(
            send(index, line["timestamp"] / 1000 / speedup, request, start)
            for index, (line, request) in enumerate(zip(lines, ready, strict=True))
        )
    )
    return results, time.perf_counter() - start


def summary(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    """What a run measured."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    errors = [r.error for r in results if not r.ok]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "elapsed_s": round(elapsed, 2),
        "ttft_ms": {q: round(percentile(ttfts, q) * 1e3, 1) for q in (50, 99)},
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(cached) if cached else None,
        "output_tokens": sum(r.tokens for r in ok),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    lines = [json.loads(text) for text in args.trace.read_text().splitlines() if text.strip()]
    before = sum(cpu_seconds(pid) for pid in args.server_pid)
    results, elapsed = await replay(
        args.url, args.model, lines, speedup=args.speedup, offset=args.id_offset
    )
    report = summary(results, elapsed)
    if args.server_pid:
        cpu = sum(cpu_seconds(pid) for pid in args.server_pid) - before
        report["server_cpu_s"] = round(cpu, 3)
        report["server_cpu_ms_per_request"] = round(cpu * 1e3 / max(len(results), 1), 3)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server's base URL")
    parser.add_argument("--model", required=True)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--speedup", type=float, default=1.0, help="timestamps divided by it")
    parser.add_argument("--id-offset", type=int, default=0, help="added to every hash id")
    parser.add_argument("--server-pid", type=int, action="append", default=[])
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = uvloop.run if uvloop is not None else asyncio.run
    report = run(main_async(args))
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
