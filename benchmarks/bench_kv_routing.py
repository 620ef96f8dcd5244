"""KV-aware routing against round-robin and least-loaded on a multi-turn trace (issue 16).

Run on demand: ``.venv/bin/python benchmarks/bench_kv_routing.py [--conversations N]
[--turns T] [--runs R]``.

Four in-process :class:`MockerEngine` workers with a prefix cache each (``cache_blocks``)
behind a ``Router``; ``kv`` is :class:`pipeline.KvRouter` over one ``PrefixIndex`` fed by
the mockers' KV events, applied in-process (as ``serve --router kv`` wires it). The
workload: N conversations sharing a system prompt; each turn's prompt is the previous
prompt, the previous answer and a new question. The conversations run concurrently
(closed loop: a client sends its next turn a random pause, ``--think-ms`` on average,
after the previous answer is complete), so their turns interleave on the workers. Without
the pause, the conversations a kv router keeps on one worker finish in the same step and
all send their next turn into the same next step, whose prefill then delays them all: a
lockstep no real set of users keeps, which would charge kv for the benchmark's own rhythm.
Every router sees the same trace: questions are seeded
and answers are a function of the prompt (``tokens="random"``).

Measured per router (median over ``--runs``): prompt tokens prefilled (what the mockers
computed), the cache hit rate (prompt tokens found cached / all prompt tokens), TTFT p50
and p99, output tokens/s over the whole run. Times are the mocker's model of an
accelerator (``--prefill-ms-per-token`` per uncached prompt token joins the worker's next
step) plus the framework's own cost, on the real clock.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

from operators.contracts.llm import EngineOutput, PreprocessedRequest, StopConditions
from operators.engines.mocker import MockerEngine
from operators.routing.kv_policy import llm_kv_router
from pipeline import Context, LeastLoaded, RoundRobin, Router, WorkerSet, open_stream
from pipeline.prefix_index import KvEvent, PrefixIndex
from pipeline.routers import RoutingPolicy

ROUTERS = ("kv", "round-robin", "least-loaded")
Workers = WorkerSet[PreprocessedRequest, EngineOutput]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def build(router: str, args: argparse.Namespace) -> tuple[Router[Any, Any], list[MockerEngine]]:
    """Four fresh mockers (empty caches) behind ``router``."""
    engines = [
        MockerEngine(
            worker_id=f"w{i}",
            prefill_ms_per_token=args.prefill_ms_per_token,
            decode_ms_per_step=args.decode_ms_per_step,
            tokens="random",
            block_size=args.block_size,
            cache_blocks=args.cache_blocks,
        )
        for i in range(args.workers)
    ]
    workers: Workers = WorkerSet("decode", {engine.worker_id: engine for engine in engines})
    policy: RoutingPolicy
    if router == "kv":
        index = PrefixIndex()
        for engine in engines:
            engine.kv_events = _sink(index, engine.worker_id)
        policy = llm_kv_router(
            index, block_size=args.block_size, overlap_weight=args.overlap_weight, seed=0
        )
    elif router == "round-robin":
        policy = RoundRobin()
    else:
        policy = LeastLoaded()
    return Router(workers, policy), engines


def _sink(index: PrefixIndex, worker: str) -> Callable[[KvEvent], None]:
    def apply(event: KvEvent) -> None:
        index.apply(worker, event)

    return apply


async def run_once(router_name: str, args: argparse.Namespace) -> dict[str, float]:
    router, engines = build(router_name, args)
    system = [random.Random(-1).randrange(256, 4096) for _ in range(args.system_tokens)]
    ttft: list[float] = []
    output_tokens = 0

    async def conversation(number: int) -> None:
        nonlocal output_tokens
        rng = random.Random(number)
        prompt = list(system)
        await anyio.sleep(number * args.stagger_ms / 1000)  # clients arrive spread out
        for _turn in range(args.turns):
            prompt += [rng.randrange(256, 4096) for _ in range(args.question_tokens)]
            request = PreprocessedRequest(
                token_ids=list(prompt), stop=StopConditions(max_tokens=args.answer_tokens)
            )
            start = time.perf_counter()
            answer: list[int] = []
            async with open_stream(router, Context.new(request)) as stream:
                async for output in stream:
                    if not answer and output.token_ids:
                        ttft.append(time.perf_counter() - start)
                    answer += output.token_ids
            output_tokens += len(answer)
            prompt += answer
            # The user reads the answer and types: without this pause, the clients sharing a
            # worker finish together and all send their next turn into the same engine step.
            await anyio.sleep(rng.expovariate(1000 / args.think_ms) if args.think_ms else 0)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for number in range(args.conversations):
            tg.start_soon(conversation, number)
    elapsed = time.perf_counter() - start
    computed = sum(engine.statistics().prefill_tokens for engine in engines)
    cached = sum(engine.statistics().cached_prompt_tokens for engine in engines)
    return {
        "prefill_tokens": computed,
        "hit_rate": cached / max(computed + cached, 1),
        "ttft_p50_ms": percentile(ttft, 50) * 1000,
        "ttft_p99_ms": percentile(ttft, 99) * 1000,
        "tokens_per_s": output_tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=1024, help="per worker")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    parser.add_argument("--decode-ms-per-step", type=float, default=2.0)
    parser.add_argument("--overlap-weight", type=float, default=2.0)
    parser.add_argument("--stagger-ms", type=float, default=50.0)
    parser.add_argument(
        "--think-ms", type=float, default=200.0, help="mean pause between turns (exponential)"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per router; medians shown")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    args = parser.parse_args()
    print(
        f"{args.workers} mocker workers, {args.conversations} conversations x {args.turns} "
        f"turns, system prompt {args.system_tokens} tokens, +{args.question_tokens} question "
        f"+{args.answer_tokens} answer per turn, cache {args.cache_blocks} blocks of "
        f"{args.block_size}, prefill {args.prefill_ms_per_token} ms/token, decode "
        f"{args.decode_ms_per_step} ms/step, think {args.think_ms} ms; median of {args.runs} runs"
    )
    header = ("router", "prefill tok", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "tok/s")
    print("{:<14}{:>13}{:>10}{:>13}{:>13}{:>9}".format(*header))
    for name in args.routers.split(","):
        runs = [anyio.run(run_once, name, args) for _ in range(args.runs)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"{name:<14}{median['prefill_tokens']:>13,.0f}{median['hit_rate']:>10.1%}"
            f"{median['ttft_p50_ms']:>13.1f}{median['ttft_p99_ms']:>13.1f}"
            f"{median['tokens_per_s']:>9,.0f}"
        )


if __name__ == "__main__":
    main()
