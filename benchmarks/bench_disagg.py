"""Aggregated vs disaggregated serving on mocker workers: TTFT, inter-token latency, tokens/s.

Run on demand: ``.venv/bin/python benchmarks/bench_disagg.py [--requests N] [--concurrency C]``.

Every request goes in-process through ``link(Backend, PrefillRouter, Router(decode))``; with
no prefill workers the PrefillRouter is a passthrough and the decode set holds aggregated
workers. The workers are :class:`MockerEngine` s, so the times are the mocker's model of an
accelerator (one shared step clock per worker; a step lasts ``decode_ms_per_step`` plus
``prefill_ms_per_token`` per prompt token admitted into it), plus the framework's own
cost. The zero-cost rows run the graphs on workers that take no time: what is left is the
framework's own cost (routers, the prefill handoff, Backend detokenization, the mocker's
bookkeeping).

Clients run closed-loop: each sends its next request when the previous one finishes.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import anyio

from operators.backend import Backend
from operators.contracts.llm import EngineOutput, PreprocessedRequest, StopConditions
from operators.engines.mocker import MockerEngine, Role
from operators.routing.prefill_router import PrefillRouter
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Router, WorkerSet, link, open_stream

TEXT = (
    "The committee met on a grey Tuesday to review the quarterly numbers, and nobody "
    "expected the discussion to turn to the history of lighthouses, their keepers, the "
    "lenses they polished and the storms they outlasted along a long and rocky coast. "
)
PROMPT_TOKENS = 256  # mean prompt length
MAX_TOKENS = 128  # mean output length

Workers = WorkerSet[PreprocessedRequest, EngineOutput]


@dataclass
class Results:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def make_requests(tokenizer: Tokenizer, count: int) -> list[PreprocessedRequest]:
    """Prompts of 128..384 tokens and 64..192 output tokens, spread evenly (deterministic).

    Lengths vary so that closed-loop clients do not stay in lockstep waves.
    """
    ids = tokenizer.encode(TEXT * 40)
    eos = tuple(sorted(tokenizer.eos_token_ids))
    requests = []
    for i in range(count):
        prompt = PROMPT_TOKENS // 2 + (i * 61) % (PROMPT_TOKENS + 1)
        output = MAX_TOKENS // 2 + (i * 37) % (MAX_TOKENS + 1)
        offset = i % 97
        requests.append(
            PreprocessedRequest(
                token_ids=ids[offset : offset + prompt],
                stop=StopConditions(max_tokens=output, eos_token_ids=eos),
            )
        )
    return requests


def workers(tokenizer: Tokenizer, role: Role, count: int, **timing: float) -> Workers:
    return WorkerSet(
        role,
        {
            f"{role}-{i}": MockerEngine.from_tokenizer(
                tokenizer, role=role, worker_id=f"{role}-{i}", **timing
            )
            for i in range(count)
        },
    )


async def run(
    tokenizer: Tokenizer,
    requests: list[PreprocessedRequest],
    concurrency: int,
    pools: dict[str, int],
    timing: dict[str, float],
) -> tuple[Results, float]:
    """Serve ``requests`` from ``concurrency`` closed-loop clients; results and wall time."""
    if "prefill" in pools:
        prefill_set = workers(tokenizer, "prefill", pools["prefill"], **timing)
        decode_set = workers(tokenizer, "decode", pools["decode"], **timing)
    else:
        prefill_set = None
        decode_set = workers(tokenizer, "aggregated", pools["aggregated"], **timing)
    graph = link(Backend(tokenizer), PrefillRouter(prefill_set), Router(decode_set))
    results = Results()
    queue = iter(requests)

    async def client() -> None:
        for request in queue:
            start = last = time.perf_counter()
            first = True
            async with open_stream(graph, Context.new(request)) as stream:
                async for output in stream:
                    if not output.token_ids:
                        continue
                    now = time.perf_counter()
                    if first:
                        results.ttft.append(now - start)
                        first = False
                    else:
                        results.itl.append(now - last)
                    last = now
                    results.tokens += len(output.token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(client)
    return results, time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    tokenizer = Tokenizer.default()
    requests = make_requests(tokenizer, args.requests)
    timing = {"prefill_ms_per_token": 0.05, "decode_ms_per_step": 5.0}
    free = {"prefill_ms_per_token": 0.0, "decode_ms_per_step": 0.0}
    print(
        f"{args.requests} requests, concurrency {args.concurrency}, prompts "
        f"{PROMPT_TOKENS // 2}..{PROMPT_TOKENS * 3 // 2} tokens, outputs "
        f"{MAX_TOKENS // 2}..{MAX_TOKENS * 3 // 2} tokens; mocker prefill "
        f"{timing['prefill_ms_per_token']} ms/token, decode {timing['decode_ms_per_step']} ms/step"
    )
    header = f"{'workers':<26}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>10}{'p99':>9}{'tokens/s':>11}"
    print(header + "   (latencies in ms)")
    scenarios: list[tuple[str, dict[str, int], dict[str, float]]] = [
        ("1 aggregated", {"aggregated": 1}, timing),
        ("2 aggregated", {"aggregated": 2}, timing),
        ("1 prefill + 1 decode", {"prefill": 1, "decode": 1}, timing),
        ("2 prefill + 1 decode", {"prefill": 2, "decode": 1}, timing),
        ("1 aggregated, zero-cost", {"aggregated": 1}, free),
        ("1P+1D, zero-cost", {"prefill": 1, "decode": 1}, free),
    ]
    for label, pools, costs in scenarios:
        results, elapsed = await run(tokenizer, requests, args.concurrency, pools, costs)
        assert results.tokens == sum(r.stop.max_tokens or 0 for r in requests)
        print(
            f"{label:<26}"
            f"{percentile(results.ttft, 50) * 1e3:>10.1f}{percentile(results.ttft, 99) * 1e3:>9.1f}"
            f"{percentile(results.itl, 50) * 1e3:>10.2f}{percentile(results.itl, 99) * 1e3:>9.2f}"
            f"{results.tokens / elapsed:>11,.0f}"
        )


if __name__ == "__main__":
    anyio.run(main)
