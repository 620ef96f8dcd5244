"""Prometheus collectors of the engines' own statistics, read at scrape time.

The HTTP edge counts requests (:mod:`operators.edges.http.metrics`); what an engine does
with them (its batch, its KV cache and tiers, its drafts, its prefills) is known only to
the engine, and the edge knows no engine. So each engine's statistics are exposed here, as
a function that registers a collector in a registry (the server's,
``ServerMetrics.registry``) reading a callable at every scrape: nothing is counted twice
and nothing runs between scrapes. The entry points that load the engines wire them
(:mod:`operators.cli.engines`). The NamedTuples are what the callables return: an engine's
statistics, renamed to the series they feed.

Series::

    llm_pipeline_speculative_{proposed,accepted}_tokens_total   counters, draft tokens
    llm_pipeline_llama_running_sequences             gauge, sequences in a slot (llama engine)
    llm_pipeline_llama_waiting_sequences             gauge, sequences waiting for a slot
    llm_pipeline_llama_batch_size                    histogram, sequences per engine step
    llm_pipeline_llama_prefill_tokens_total          counter, prompt tokens evaluated
    llm_pipeline_llama_cached_prompt_tokens_total    counter, prompt tokens found in the cache
    llm_pipeline_llama_decode_tokens_total           counter, tokens fed to decode (+ drafts)
    llm_pipeline_kv_tier_hits_total{tier}            counter, KV blocks restored from a tier
    llm_pipeline_kv_restored_tokens_total{tier}      counter, prompt tokens restored from a tier
    llm_pipeline_kv_saved_blocks_total{tier}         counter, KV blocks saved to the first tier
    llm_pipeline_kv_transferred_tokens_total         counter, prompt tokens pulled (decode)
    llm_pipeline_kv_transferred_bytes_total          counter, their bytes
    llm_pipeline_kv_transfer_recomputed_total        counter, handles prefilled again instead
    llm_pipeline_kv_transfer_seconds_total           counter, time spent pulling KV (decode)
    llm_pipeline_vllm_running_requests               gauge, requests vLLM runs (vllm engine)
    llm_pipeline_vllm_waiting_requests               gauge, requests waiting in vLLM's queue
    llm_pipeline_vllm_kv_cache_usage_ratio           gauge, fraction of vLLM's KV blocks in use
    llm_pipeline_vllm_prefix_cache_{queries,hits}_total  counters, prompt tokens looked up/found
    llm_pipeline_vllm_preemptions_total              counter, requests preempted for KV room
    llm_pipeline_prefill_tokens_total{worker}        counter, prompt tokens prefilled (mocker)
    llm_pipeline_cached_prompt_tokens_total{worker}  counter, prompt tokens found cached (mocker)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

__all__ = (
    "BatchingCounts",
    "EngineLoad",
    "KvCounts",
    "watch_batching",
    "watch_engine",
    "watch_kv",
    "watch_prefill",
    "watch_speculation",
)


class _SpeculationCollector(Collector):
    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        proposed, accepted = self._counts()
        yield CounterMetricFamily(
            "llm_pipeline_speculative_proposed_tokens",
            "Draft tokens proposed by speculative decoding.",
            value=proposed,
        )
        yield CounterMetricFamily(
            "llm_pipeline_speculative_accepted_tokens",
            "Draft tokens that matched the model's own choice and were kept.",
            value=accepted,
        )


class BatchingCounts(NamedTuple):
    """What :func:`watch_batching` reads from a batching engine at scrape time."""

    #: sequences decoding or prefilling now
    running: int
    #: sequences waiting for a slot now
    waiting: int
    #: steps by batch size: ``batch_sizes[k]`` steps held k sequences
    batch_sizes: Sequence[int]
    #: prompt tokens evaluated so far
    prefill_tokens: int
    #: prompt tokens found in the cache so far
    cached_prompt_tokens: int
    #: tokens fed to decode steps so far (one per sequence and step, plus drafts)
    decode_tokens: int


class _BatchingCollector(Collector):
    def __init__(self, counts: Callable[[], BatchingCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        yield GaugeMetricFamily(
            "llm_pipeline_llama_running_sequences",
            "Sequences in one of the llama engine's slots (decoding or prefilling).",
            value=counts.running,
        )
        yield GaugeMetricFamily(
            "llm_pipeline_llama_waiting_sequences",
            "Sequences waiting for a slot of the llama engine.",
            value=counts.waiting,
        )
        yield _batch_size_family(counts.batch_sizes)
        yield CounterMetricFamily(
            "llm_pipeline_llama_prefill_tokens",
            "Prompt tokens the llama engine evaluated (not found in its cache).",
            value=counts.prefill_tokens,
        )
        yield CounterMetricFamily(
            "llm_pipeline_llama_cached_prompt_tokens",
            "Prompt tokens the llama engine found in its cache (prefix reuse, n > 1).",
            value=counts.cached_prompt_tokens,
        )
        yield CounterMetricFamily(
            "llm_pipeline_llama_decode_tokens",
            "Tokens the llama engine fed to decode: one per sequence and step, plus drafts.",
            value=counts.decode_tokens,
        )


class KvCounts(NamedTuple):
    """What :func:`watch_kv` reads from engines that move KV, at scrape time."""

    #: KV blocks restored from each tier ("host", "disk")
    tier_hits: Mapping[str, int]
    #: prompt tokens those blocks held (not already in the slot), by tier
    restored_tokens: Mapping[str, int]
    #: KV blocks saved to the first tier before their slot was overwritten
    saved_blocks: Mapping[str, int]
    #: prompt tokens (cells) a decode worker pulled from prefill workers, and their bytes
    transferred_tokens: int
    transferred_bytes: int
    #: transfer handles whose KV could not be pulled (the decode worker prefilled)
    transfer_recomputed: int
    #: seconds decode workers spent pulling KV
    transfer_seconds: float = 0.0


#: the tiers shown (at 0) before their first count
_TIERS: Final = ("host", "disk")


class _KvCollector(Collector):
    def __init__(self, counts: Callable[[], KvCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        for name, documentation, values in (
            (
                "llm_pipeline_kv_tier_hits",
                "KV blocks restored into a slot from a tier below it, by tier.",
                counts.tier_hits,
            ),
            (
                "llm_pipeline_kv_restored_tokens",
                "Prompt tokens restored from a KV tier instead of prefilled, by tier.",
                counts.restored_tokens,
            ),
            (
                "llm_pipeline_kv_saved_blocks",
                "KV blocks saved to the first tier before their slot was overwritten.",
                counts.saved_blocks,
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=["tier"])
            for tier in sorted({*_TIERS, *values}):
                family.add_metric([tier], values.get(tier, 0))
            yield family
        yield CounterMetricFamily(
            "llm_pipeline_kv_transferred_tokens",
            "Prompt tokens whose KV a decode worker pulled from a prefill worker.",
            value=counts.transferred_tokens,
        )
        yield CounterMetricFamily(
            "llm_pipeline_kv_transferred_bytes",
            "Bytes of KV a decode worker pulled from prefill workers.",
            value=counts.transferred_bytes,
        )
        yield CounterMetricFamily(
            "llm_pipeline_kv_transfer_recomputed",
            "Transfer handles whose KV could not be pulled: the decode worker prefilled.",
            value=counts.transfer_recomputed,
        )
        yield CounterMetricFamily(
            "llm_pipeline_kv_transfer_seconds",
            "Seconds decode workers spent pulling KV from prefill workers.",
            value=counts.transfer_seconds,
        )


def _batch_size_family(batch_sizes: Sequence[int]) -> HistogramMetricFamily:
    """Steps by batch size as a histogram with power-of-two bounds up to the largest size."""
    largest = len(batch_sizes) - 1
    bounds = [1 << i for i in range(largest.bit_length()) if 1 << i < largest] + [largest]
    buckets: list[tuple[str, float]] = []
    total = 0
    size = 0
    for bound in bounds if largest > 0 else []:
        while size <= bound:
            total += batch_sizes[size]
            size += 1
        buckets.append((repr(float(bound)), total))
    buckets.append(("+Inf", sum(batch_sizes)))
    return HistogramMetricFamily(
        "llm_pipeline_llama_batch_size",
        "Sequences in one step of the llama engine (one llama_decode).",
        buckets=buckets,
        sum_value=sum(size * steps for size, steps in enumerate(batch_sizes)),
    )


class EngineLoad(NamedTuple):
    """What :func:`watch_engine` reads at scrape time from an engine that schedules its own
    batch (vLLM reports it once per step)."""

    #: requests (choices) running now
    running: int
    #: requests (choices) waiting for room in the batch or the KV cache
    waiting: int
    #: fraction of KV cache blocks in use (0..1)
    kv_cache_usage: float
    #: prompt tokens looked up in the prefix cache so far, and found there
    prefix_cache_queries: int
    prefix_cache_hits: int
    #: requests preempted so far (their KV dropped for room, recomputed later)
    preemptions: int


class _EngineLoadCollector(Collector):
    def __init__(self, engine: str, load: Callable[[], EngineLoad]) -> None:
        self._engine = engine
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load, name = self._load(), f"llm_pipeline_{self._engine}"
        yield GaugeMetricFamily(
            f"{name}_running_requests", "Requests the engine is running.", value=load.running
        )
        yield GaugeMetricFamily(
            f"{name}_waiting_requests",
            "Requests waiting for room in the engine's batch or KV cache.",
            value=load.waiting,
        )
        yield GaugeMetricFamily(
            f"{name}_kv_cache_usage_ratio",
            "Fraction of the engine's KV cache blocks in use.",
            value=load.kv_cache_usage,
        )
        yield CounterMetricFamily(
            f"{name}_prefix_cache_queries",
            "Prompt tokens the engine looked up in its prefix cache.",
            value=load.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            f"{name}_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache.",
            value=load.prefix_cache_hits,
        )
        yield CounterMetricFamily(
            f"{name}_preemptions",
            "Requests the engine preempted (KV dropped for room, recomputed later).",
            value=load.preemptions,
        )


class _PrefillCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        computed = CounterMetricFamily(
            "llm_pipeline_prefill_tokens",
            "Prompt tokens a worker prefilled (not found in its prefix cache).",
            labels=["worker"],
        )
        cached = CounterMetricFamily(
            "llm_pipeline_cached_prompt_tokens",
            "Prompt tokens a worker found in its prefix cache (their prefill was skipped).",
            labels=["worker"],
        )
        for worker, (prefilled, found) in sorted(self._counts().items()):
            computed.add_metric([worker], prefilled)
            cached.add_metric([worker], found)
        yield computed
        yield cached


def watch_speculation(registry: CollectorRegistry, counts: Callable[[], tuple[int, int]]) -> None:
    """Expose an engine's speculative-decoding counts in ``registry``, read at scrape time.

    ``counts()`` returns (draft tokens proposed, draft tokens accepted) so far.
    """
    registry.register(_SpeculationCollector(counts))


def watch_batching(registry: CollectorRegistry, counts: Callable[[], BatchingCounts]) -> None:
    """Expose a batching engine's load and step counts in ``registry``, read at scrape time."""
    registry.register(_BatchingCollector(counts))


def watch_kv(registry: CollectorRegistry, counts: Callable[[], KvCounts]) -> None:
    """Expose engines' KV tier and transfer counts in ``registry``, read at scrape time."""
    registry.register(_KvCollector(counts))


def watch_engine(registry: CollectorRegistry, engine: str, load: Callable[[], EngineLoad]) -> None:
    """Expose an engine's own scheduler load in ``registry`` as ``llm_pipeline_{engine}_*``,
    read at scrape time."""
    registry.register(_EngineLoadCollector(engine, load))


def watch_prefill(
    registry: CollectorRegistry, counts: Callable[[], Mapping[str, tuple[int, int]]]
) -> None:
    """Expose workers' prefill counts in ``registry``, read at scrape time: ``counts()`` maps
    a worker id to (prompt tokens prefilled, prompt tokens found in its prefix cache)."""
    registry.register(_PrefillCollector(counts))
