"""The engines' collectors, read at scrape time from a registry (the server's own, as
``serve`` registers them): their series' names, labels and values."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest

from operators.edges.http.metrics import ServerMetrics
from operators.telemetry.engine_metrics import (
    BatchingCounts,
    EngineLoad,
    KvCounts,
    watch_batching,
    watch_engine,
    watch_kv,
    watch_prefill,
    watch_speculation,
)


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match[1])


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_batching_series_are_read_at_scrape_time() -> None:
    registry = CollectorRegistry()
    counts = BatchingCounts(
        running=3,
        waiting=2,
        batch_sizes=[0, 5, 1, 0, 4, 0, 2],  # steps by batch size, up to parallel = 6
        prefill_tokens=120,
        cached_prompt_tokens=30,
        decode_tokens=42,
    )
    watch_batching(registry, lambda: counts)
    text = render(registry)
    assert sample(text, "llm_pipeline_llama_running_sequences") == 3
    assert sample(text, "llm_pipeline_llama_waiting_sequences") == 2
    assert sample(text, "llm_pipeline_llama_prefill_tokens_total") == 120
    assert sample(text, "llm_pipeline_llama_cached_prompt_tokens_total") == 30
    assert sample(text, "llm_pipeline_llama_decode_tokens_total") == 42
    # cumulative buckets at powers of two and at the largest batch size
    histogram = "llm_pipeline_llama_batch_size"
    assert sample(text, histogram + '_bucket{le="1.0"}') == 5
    assert sample(text, histogram + '_bucket{le="2.0"}') == 6
    assert sample(text, histogram + '_bucket{le="4.0"}') == 10
    assert sample(text, histogram + '_bucket{le="6.0"}') == 12
    assert sample(text, histogram + '_bucket{le="+Inf"}') == 12
    assert sample(text, histogram + "_count") == 12
    assert sample(text, histogram + "_sum") == 5 + 2 + 16 + 12


def test_batch_size_histogram_of_one_slot() -> None:
    registry = CollectorRegistry()
    watch_batching(registry, lambda: BatchingCounts(0, 0, [0, 7], 0, 0, 0))
    text = render(registry)
    assert sample(text, 'llm_pipeline_llama_batch_size_bucket{le="1.0"}') == 7
    assert sample(text, "llm_pipeline_llama_batch_size_sum") == 7


def test_each_scrape_reads_the_counts_again() -> None:
    registry = CollectorRegistry()
    counts = [(4, 1)]
    watch_speculation(registry, lambda: counts[-1])
    assert sample(render(registry), "llm_pipeline_speculative_proposed_tokens_total") == 4
    counts.append((9, 6))
    text = render(registry)
    assert sample(text, "llm_pipeline_speculative_proposed_tokens_total") == 9
    assert sample(text, "llm_pipeline_speculative_accepted_tokens_total") == 6


def test_kv_series_show_both_tiers_before_their_first_count() -> None:
    registry = CollectorRegistry()
    counts = KvCounts(
        tier_hits={"host": 3},
        restored_tokens={"host": 48},
        saved_blocks={},
        transferred_tokens=64,
        transferred_bytes=4096,
        transfer_recomputed=1,
        transfer_seconds=0.25,
    )
    watch_kv(registry, lambda: counts)
    text = render(registry)
    assert sample(text, 'llm_pipeline_kv_tier_hits_total{tier="host"}') == 3
    assert sample(text, 'llm_pipeline_kv_tier_hits_total{tier="disk"}') == 0
    assert sample(text, 'llm_pipeline_kv_restored_tokens_total{tier="host"}') == 48
    assert sample(text, 'llm_pipeline_kv_saved_blocks_total{tier="disk"}') == 0
    assert sample(text, "llm_pipeline_kv_transferred_tokens_total") == 64
    assert sample(text, "llm_pipeline_kv_transferred_bytes_total") == 4096
    assert sample(text, "llm_pipeline_kv_transfer_recomputed_total") == 1
    assert sample(text, "llm_pipeline_kv_transfer_seconds_total") == 0.25


def test_an_engines_own_load_is_named_for_the_engine() -> None:
    registry = CollectorRegistry()
    load = EngineLoad(
        running=2,
        waiting=5,
        kv_cache_usage=0.5,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        preemptions=1,
    )
    watch_engine(registry, "vllm", lambda: load)
    text = render(registry)
    assert sample(text, "llm_pipeline_vllm_running_requests") == 2
    assert sample(text, "llm_pipeline_vllm_waiting_requests") == 5
    assert sample(text, "llm_pipeline_vllm_kv_cache_usage_ratio") == 0.5
    assert sample(text, "llm_pipeline_vllm_prefix_cache_queries_total") == 100
    assert sample(text, "llm_pipeline_vllm_prefix_cache_hits_total") == 40
    assert sample(text, "llm_pipeline_vllm_preemptions_total") == 1


def test_prefill_counts_are_labelled_by_worker() -> None:
    registry = CollectorRegistry()
    watch_prefill(registry, lambda: {"w1": (30, 10), "w0": (12, 0)})
    text = render(registry)
    assert sample(text, 'llm_pipeline_prefill_tokens_total{worker="w0"}') == 12
    assert sample(text, 'llm_pipeline_prefill_tokens_total{worker="w1"}') == 30
    assert sample(text, 'llm_pipeline_cached_prompt_tokens_total{worker="w1"}') == 10


def test_the_server_renders_the_engines_series_with_its_own() -> None:
    metrics = ServerMetrics()
    watch_speculation(metrics.registry, lambda: (2, 1))
    metrics.count_request("chat", 200, "m")
    text = metrics.render().decode()
    assert sample(text, "llm_pipeline_speculative_accepted_tokens_total") == 1
    assert sample(text, 'llm_pipeline_requests_total{endpoint="chat",model="m",status="200"}') == 1
