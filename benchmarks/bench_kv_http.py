"""The multi-turn KV-routing trace over HTTP, against any OpenAI-compatible server (issue 16).

    python benchmarks/bench_kv_http.py --url http://127.0.0.1:8000 --model NAME \\
        [--conversations 32] [--turns 6] [--runs 2] [--label ours-kv] [--json FILE]
    python benchmarks/bench_kv_http.py --report FILE   # medians per label, kv/rr ratios

The workload of ``bench_kv_routing.py``, as chat completions: N conversations share a
system prompt; each turn sends the whole conversation so far (system prompt, every earlier
question and the answer the server returned for it) plus a new question, streamed, with
``max_tokens`` fixed (``ignore_eos``) and ``stream_options.include_usage``. Conversations
run concurrently and closed-loop (a conversation sends its next turn a seeded random pause,
``--think-ms`` on average, after its previous answer is complete), started ``--stagger-ms``
apart, so their turns interleave on the workers, as in ``bench_kv_routing.py``. With
``--think-ms 0`` the conversations a kv router keeps on one worker finish in the same step
and send their next turns together (a lockstep worth measuring too). The trace is text,
seeded: the system prompt and the questions are words drawn from SmolLM2's vocabulary (one
token each, so ``--system-tokens`` is close to the prompt's token count), and run ``r``
uses seed ``--seed + r``: every server gets the same prompts, while no run finds the
previous run's prompts in a cache. Answers are what the server
returns, so the next turn's prompt depends on the server only through its answer text.

Printed per run and as the median over ``--runs``: requests, prompt tokens (usage), TTFT
p50/p99 from request start to the first content chunk, output tokens/s over the run, and
the cache hit rate where the server reports one:

- ``usage.prompt_tokens_details.cached_tokens`` when the server returns it;
- our server's ``/metrics``, scraped before and after the run and diffed:
  ``llm_pipeline_prefill_tokens_total{worker}`` and
  ``llm_pipeline_cached_prompt_tokens_total{worker}`` (hit rate = cached / (cached +
  prefilled), what the mockers computed) and the router's
  ``llm_pipeline_kv_hit_blocks_total`` / ``llm_pipeline_kv_miss_blocks_total``;
- Dynamo 1.6.1: its mocker reports the prompt tokens its prefix cache served in
  ``usage.prompt_tokens_details.cached_tokens`` (the frontend sums them in
  ``dynamo_frontend_cached_tokens``), so prefilled = prompt - cached; its KV router's
  prediction is ``dynamo_component_router_kv_selected_cached_prefix_tokens_total`` over
  ``dynamo_component_router_input_sequence_tokens_sum`` on the frontend's ``/metrics``.
  ``--metrics-url`` (repeatable) names the endpoints to diff instead of ``URL/metrics``.

"hit rate" is what the engines' caches served (cached / prompt tokens, ours from the
mockers' counters, Dynamo's from usage); "router hit" is what the router predicted for
the workers it chose (ours by blocks, Dynamo's by tokens).

Only the standard library and httpx are needed (the project's .venv has both). See
``README_kv.md`` for the comparison with Dynamo (``dynamo_kv_stack.sh`` starts it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
DEFAULT_TOKENIZER = HERE.parent / "operators" / "data" / "smollm2" / "tokenizer.json"

#: our server's per-worker counters (mocker) and the KV router's block counters
OURS_PREFILL = "llm_pipeline_prefill_tokens_total"
OURS_CACHED = "llm_pipeline_cached_prompt_tokens_total"
OURS_HIT = "llm_pipeline_kv_hit_blocks_total"
OURS_MISS = "llm_pipeline_kv_miss_blocks_total"
#: one llama engine (``serve --engine llama``): its own counters, no worker label
OURS_LLAMA_PREFILL = "llm_pipeline_llama_prefill_tokens_total"
OURS_LLAMA_CACHED = "llm_pipeline_llama_cached_prompt_tokens_total"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def vocabulary(tokenizer_json: Path) -> list[str]:
    """Lowercase words that are one SmolLM2 token each when preceded by a space."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    words = [
        token[1:]
        for token in vocab
        if token.startswith("\u0120") and token[1:].isalpha() and token[1:].islower()
    ]
    return sorted(word for word in words if len(word) >= 4)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def scrape(client: httpx.Client, urls: Sequence[str]) -> dict[str, float]:
    """Every sample of every URL, keyed ``url|name{labels}`` (unreachable URLs: none)."""
    samples: dict[str, float] = {}
    for url in urls:
        try:
            text = client.get(url, timeout=10).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is None:
                continue
            try:
                value = float(match.group(3))
            except ValueError:
                continue
            samples[f"{url}|{match.group(1)}{match.group(2) or ''}"] = value
    return samples


def diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def total(delta: dict[str, float], name: str) -> float | None:
    """The sum over label sets (and URLs) of the metric ``name``; None when absent."""
    found = [v for k, v in delta.items() if k.split("|", 1)[1].split("{", 1)[0] == name]
    return sum(found) if found else None


def per_label(delta: dict[str, float], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in delta.items():
        series = key.split("|", 1)[1]
        if series.split("{", 1)[0] == name:
            out[series[len(name) :] or "{}"] = value
    return out


@dataclass
class RunResult:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_cached_tokens: int = 0
    usage_reports_cached: bool = False
    #: llama-server's own count of prompt tokens it evaluated (``timings.prompt_n``)
    server_prefill_tokens: int = 0
    server_reports_prefill: bool = False
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float | None]:
        m = self.metrics
        prefill, cached = total(m, OURS_PREFILL), total(m, OURS_CACHED)
        if prefill is None:
            prefill, cached = total(m, OURS_LLAMA_PREFILL), total(m, OURS_LLAMA_CACHED)
        if prefill is None and self.server_reports_prefill:
            prefill = float(self.server_prefill_tokens)
            cached = float(self.prompt_tokens - self.server_prefill_tokens)
        if prefill is None and self.usage_reports_cached:
            # Dynamo's mocker reports what its prefix cache served in usage
            cached = float(self.usage_cached_tokens)
            prefill = float(self.prompt_tokens - self.usage_cached_tokens)
        hit, miss = total(m, OURS_HIT), total(m, OURS_MISS)
        out: dict[str, float | None] = {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "ttft_p50_ms": percentile(self.ttft, 50) * 1000,
            "ttft_p99_ms": percentile(self.ttft, 99) * 1000,
            "itl_ms": statistics.fmean(self.itl) * 1000 if self.itl else None,
            "tokens_per_s": self.completion_tokens / self.elapsed if self.elapsed else 0.0,
            "usage_hit_rate": (
                self.usage_cached_tokens / max(self.prompt_tokens, 1)
                if self.usage_reports_cached
                else None
            ),
            "prefill_tokens": prefill,
            "hit_rate": (
                cached / max(cached + prefill, 1)
                if prefill is not None and cached is not None
                else None
            ),
            "router_block_hit_rate": (
                hit / (hit + miss) if hit is not None and miss is not None and hit + miss else None
            ),
        }
        # Dynamo's KV router: the cached prefix it predicted on each chosen worker (tokens)
        selected = total(m, "dynamo_component_router_kv_selected_cached_prefix_tokens_total")
        routed = total(m, "dynamo_component_router_input_sequence_tokens_sum")
        if selected is not None and routed:
            out["router_block_hit_rate"] = selected / routed
        return out


class Trace:
    """The seeded prompts of one run: a system prompt and each conversation's questions."""

    def __init__(self, words: list[str], seed: int, args: argparse.Namespace) -> None:
        self.seed = seed
        rng = random.Random(seed)
        self.system = " ".join(rng.choice(words) for _ in range(args.system_tokens))
        self.questions = [
            [self._words(words, f"{seed}/{c}/{t}", args.question_tokens) for t in range(args.turns)]
            for c in range(args.conversations)
        ]

    @staticmethod
    def _words(words: list[str], seed: str, count: int) -> str:
        rng = random.Random(seed)
        return " ".join(rng.choice(words) for _ in range(count))


async def one_turn(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    messages: list[dict[str, str]],
    result: RunResult,
) -> str | None:
    body: dict[str, Any] = {
        "model": args.model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    answer: list[str] = []
    first: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            result.errors += 1
            if result.errors <= 3:
                print(f"  HTTP {response.status_code}: {response.text[:300]}")
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if isinstance(chunk.get("timings"), dict):  # llama-server's, on its last chunks
                timings = chunk["timings"]
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - start
                    answer.append(content)
    finished = time.perf_counter() - start
    result.requests += 1
    if first is not None:
        result.ttft.append(first)
        if chunks > 1:
            result.itl.append((finished - first) / (chunks - 1))
    if timings is not None and "prompt_n" in timings:
        result.server_reports_prefill = True
        result.server_prefill_tokens += int(timings["prompt_n"])
    if usage is not None:
        result.prompt_tokens += usage.get("prompt_tokens") or 0
        result.completion_tokens += usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.usage_reports_cached = True
            result.usage_cached_tokens += details["cached_tokens"]
    return "".join(answer)


async def run_once(trace: Trace, args: argparse.Namespace) -> RunResult:
    result = RunResult()
    limits = httpx.Limits(max_connections=args.conversations + 4)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:

        async def conversation(number: int) -> None:
            await asyncio.sleep(number * args.stagger_ms / 1000)
            think = random.Random(f"think/{trace.seed}/{number}")
            messages = [{"role": "system", "content": trace.system}]
            for question in trace.questions[number]:
                messages.append({"role": "user", "content": question})
                answer = await one_turn(client, args, messages, result)
                if answer is None:
                    return
                messages.append({"role": "assistant", "content": answer})
                # the user reads and types: without a pause, the conversations a kv router
                # keeps on one worker finish together and send their next turns into one step
                if args.think_ms:
                    await asyncio.sleep(think.expovariate(1000 / args.think_ms))

        start = time.perf_counter()
        await asyncio.gather(*(conversation(n) for n in range(args.conversations)))
        result.elapsed = time.perf_counter() - start
    return result


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


COLUMNS = (
    ("requests", "requests", ",.0f"),
    ("prompt tok", "prompt_tokens", ",.0f"),
    ("prefill tok", "prefill_tokens", ",.0f"),
    ("hit rate", "hit_rate", ".1%"),
    ("usage hit", "usage_hit_rate", ".1%"),
    ("router hit", "router_block_hit_rate", ".1%"),
    ("TTFT p50 ms", "ttft_p50_ms", ".1f"),
    ("TTFT p99 ms", "ttft_p99_ms", ".1f"),
    ("ITL ms", "itl_ms", ".1f"),
    ("out tok/s", "tokens_per_s", ",.0f"),
)


def row(label: str, summary: dict[str, float | None]) -> str:
    cells = [fmt(summary.get(key), spec) for _, key, spec in COLUMNS]
    return f"{label:<14}" + "".join(f"{cell:>15}" for cell in cells)


def median_summary(summaries: list[dict[str, float | None]]) -> dict[str, float | None]:
    keys = {key for summary in summaries for key in summary}
    out: dict[str, float | None] = {}
    for key in keys:
        values = [
            v
            for s in summaries
            if isinstance(v := s.get(key), int | float) and v == v  # not labels, not NaN
        ]
        out[key] = statistics.median(values) if values else None
    return out


def report(path: Path) -> None:
    """Medians per label over the runs recorded in ``path``, then each system's kv/rr ratios.

    Labels are ``SYSTEM-ROUTER`` (``dynamo-kv``, ``ours-round-robin``, ...).
    """
    runs: dict[str, list[dict[str, float | None]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        runs.setdefault(record["label"], []).append(record)
    print(f"{'label':<14}" + "".join(f"{name:>15}" for name, _, _ in COLUMNS) + "   runs")
    medians = {label: median_summary(records) for label, records in runs.items()}
    for label, summary in medians.items():
        print(row(label, summary) + f"   {len(runs[label])}")
    print("\nkv against round-robin, same system (ratio kv/rr; TTFT saved = rr - kv):")
    for system in sorted({label.rsplit("-", 1)[0] for label in medians if label.endswith("-kv")}):
        kv, rr = medians.get(f"{system}-kv"), medians.get(f"{system}-round-robin")
        if kv is None or rr is None:
            continue
        parts = []
        for name, key in (
            ("prefill tokens", "prefill_tokens"),
            ("TTFT p50", "ttft_p50_ms"),
            ("TTFT p99", "ttft_p99_ms"),
            ("tok/s", "tokens_per_s"),
        ):
            a, b = kv.get(key), rr.get(key)
            if a is not None and b:
                parts.append(f"{name} {a / b:.2f}x")
        hit_kv, hit_rr = kv.get("hit_rate"), rr.get("hit_rate")
        if hit_kv is not None and hit_rr is not None:
            parts.append(f"hit rate {hit_rr:.1%} -> {hit_kv:.1%}")
        for name, key in (("p50", "ttft_p50_ms"), ("p99", "ttft_p99_ms")):
            a, b = kv.get(key), rr.get(key)
            if a is not None and b is not None:
                parts.append(f"TTFT {name} saved {b - a:.1f} ms")
        print(f"  {system}: " + ", ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model")
    parser.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        help="Prometheus endpoints to diff around each run (repeatable; default URL/metrics)",
    )
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024, help="words, ~1 token each")
    parser.add_argument("--question-tokens", type=int, default=64, help="words, ~1 token each")
    parser.add_argument("--max-tokens", type=int, default=64, help="answer length")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--stagger-ms", type=float, default=50.0, help="between arrivals")
    parser.add_argument(
        "--think-ms", type=float, default=200.0, help="mean pause between turns (exponential)"
    )
    parser.add_argument("--seed", type=int, default=0, help="run r uses seed + r")
    parser.add_argument("--runs", type=int, default=2, help="medians shown")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--label", default="server")
    parser.add_argument("--json", type=Path, help="append one JSON line per run here")
    parser.add_argument("--show-metrics", action="store_true", help="print every changed series")
    parser.add_argument(
        "--report",
        type=Path,
        help="print the medians per label of a --json file (and kv / round-robin ratios); no load",
    )
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if not args.model:
        parser.error("--model is required")
    metrics_urls = args.metrics_url or [args.url.rstrip("/") + "/metrics"]
    words = vocabulary(args.tokenizer)
    print(
        f"{args.label}: {args.url} model {args.model}; {args.conversations} conversations x "
        f"{args.turns} turns, system ~{args.system_tokens} tokens, +{args.question_tokens} "
        f"question +{args.max_tokens} answer per turn, stagger {args.stagger_ms} ms, "
        f"think {args.think_ms} ms"
    )
    print(f"{'run':<14}" + "".join(f"{name:>15}" for name, _, _ in COLUMNS))
    summaries = []
    with httpx.Client() as sync_client:
        for run in range(args.runs):
            trace = Trace(words, args.seed + run, args)
            before = scrape(sync_client, metrics_urls)
            result = asyncio.run(run_once(trace, args))
            time.sleep(0.5)  # let per-worker counters settle
            result.metrics = diff(before, scrape(sync_client, metrics_urls))
            summary = result.summary()
            summaries.append(summary)
            print(row(f"{args.label} #{run}", summary), flush=True)
            if args.show_metrics:
                for key, value in sorted(result.metrics.items()):
                    if value and "_created" not in key:
                        print(f"    {key} {value:g}")
            workers = per_label(result.metrics, OURS_PREFILL)
            if workers:
                print("    prefill tokens per worker:", {k: int(v) for k, v in workers.items()})
            if args.json:
                with args.json.open("a") as out:
                    record = {"label": args.label, "run": run, "seed": args.seed + run, **summary}
                    out.write(json.dumps(record) + "\n")
    print(row(f"{args.label} med", median_summary(summaries)))


if __name__ == "__main__":
    main()
