"""The cost of adapters (LoRA) in the llama engine: two adapters and the base model
interleaved, against the base model alone (and one adapter alone), in process.

    python benchmarks/bench_lora.py [--concurrency 4 8] [--parallel 8] [--reps 3] \\
        [--prompt-tokens 64] [--max-tokens 64] [--requests 24]

llama.cpp applies an adapter to the whole context, so the engine's scheduler steps one
adapter's sequences at a time and alternates between the groups with work: with three
groups each sequence gets a step in three, and a step holds a third of the batch. This
measures what that costs a closed loop of ``--concurrency`` clients (each sends its next
request when its answer ends; request i names the base model, adapter ``a`` or ``b`` in
turn). The mixes:

- ``base``: every request on the base model (the reference);
- ``one adapter``: every request on adapter ``a`` (the adapter's own compute: rank-8
  updates of three layers' ``attn_q``/``attn_v``);
- ``base+a+b``: the three interleaved (the grouping's cost on top).

One engine serves every mix (both adapters loaded), measured rep by rep in alternation
(base, one adapter, mixed, base, ...) so that a neighbour's load hits them alike. Printed
per mix and concurrency: output tokens/s, TTFT p50/p99 and ITL p50 (ms), the median over
reps and their range. The adapters are random (``write_lora_adapter``) and outputs are not
checked here (the tests do): every request generates exactly ``--max-tokens`` tokens
(``ignore_eos``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from operators.contracts.llm import PreprocessedRequest, SamplingOptions, StopConditions
from operators.engines.llama import LlamaEngine, LlamaOptions
from operators.engines.llama.lora_file import write_lora_adapter
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import open_stream
from pipeline.testing import make_context

MIXES: dict[str, tuple[str | None, ...]] = {
    "base": (None,),
    "one adapter": ("a",),
    "base+a+b": (None, "a", "b"),
}
TOPICS = ("a lighthouse", "the sea", "a mountain", "a city", "a forest", "a river", "a desert")


def prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` different chat prompts of about ``length`` tokens."""
    found = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Request {i}. Tell me a long story about {topic}. " * 40
        head = tokenizer.encode(f"<|im_start|>user\n{text}")[: max(8, length - 6)]
        found.append(head + tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n"))
    return found


async def run_mix(
    engine: LlamaEngine,
    groups: tuple[str | None, ...],
    work: list[list[int]],
    concurrency: int,
    max_tokens: int,
) -> dict[str, float]:
    """One closed-loop run: ``concurrency`` clients take the prompts in turn."""
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0
    pending = iter(enumerate(work))

    async def client() -> None:
        nonlocal tokens
        for i, prompt in pending:
            request = PreprocessedRequest(
                token_ids=prompt,
                stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
                sampling=SamplingOptions(temperature=0.0),
                lora=groups[i % len(groups)],
            )
            start = last = time.perf_counter()
            first = True
            async with open_stream(engine, make_context(request)) as stream:
                async for output in stream:
                    now = time.perf_counter()
                    if first:
                        ttfts.append(now - start)
                        first = False
                    elif output.token_ids:
                        itls.append((now - last) / len(output.token_ids))
                    last = now
                    tokens += len(output.token_ids)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(client)
    elapsed = time.perf_counter() - started
    ttfts.sort()
    return {
        "tok/s": tokens / elapsed,
        "ttft p50": statistics.median(ttfts) * 1e3,
        "ttft p99": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1e3,
        "itl p50": statistics.median(itls) * 1e3 if itls else 0.0,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=24, help="per run")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    model = find_smollm2_gguf()
    with tempfile.TemporaryDirectory() as folder:
        loras = {
            name: write_lora_adapter(model, Path(folder) / f"{name}.gguf", seed=seed)
            for seed, name in enumerate(("a", "b"))
        }
        options = LlamaOptions(n_threads=args.threads, parallel=args.parallel, loras=loras)
        engine = await anyio.to_thread.run_sync(lambda: LlamaEngine(model, options=options))
    tokenizer = Tokenizer.default()
    print(
        f"llama engine, --parallel {args.parallel}, {args.threads} threads, "
        f"{args.prompt_tokens}-token prompts -> {args.max_tokens} tokens, "
        f"{args.requests} requests per run, {args.reps} reps in alternation, "
        f"{os.cpu_count()} CPUs"
    )
    try:
        # warm up: the first steps of each group (and of a batch size) pay one-time costs
        warm = prompts(tokenizer, 3, args.prompt_tokens)
        await run_mix(engine, MIXES["base+a+b"], [[7, *p] for p in warm], 3, 4)
        for concurrency in args.concurrency:
            results: dict[str, list[dict[str, float]]] = {mix: [] for mix in MIXES}
            for rep in range(args.reps):
                # fresh prompts per rep: no run finds another's prefix cached
                work = prompts(tokenizer, args.requests * (rep + 1), args.prompt_tokens)
                work = work[args.requests * rep :]
                for mix, groups in MIXES.items():
                    tagged = [[*p[:-6], 1000 + len(mix), *p[-6:]] for p in work]
                    results[mix].append(
                        await run_mix(engine, groups, tagged, concurrency, args.max_tokens)
                    )
            print(f"\nc={concurrency}")
            heads = ("tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms")
            print(f"  {'mix':<12} " + " ".join(f"{head:>16}" for head in heads))
            for mix, runs in results.items():
                cells = []
                for key in ("tok/s", "ttft p50", "ttft p99", "itl p50"):
                    values = [run[key] for run in runs]
                    cells.append(
                        f"{statistics.median(values):7.1f} [{min(values):.0f}-{max(values):.0f}]"
                    )
                print(f"  {mix:<12} " + " ".join(f"{cell:>16}" for cell in cells))
    finally:
        await engine.aclose()


if __name__ == "__main__":
    anyio.run(main)
