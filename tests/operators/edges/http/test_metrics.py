"""ServerMetrics' collectors read at scrape time: the llama engine's batching series."""

from __future__ import annotations

import re

from operators.edges.http.metrics import BatchingCounts, ServerMetrics


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match[1])


def test_batching_series_are_read_at_scrape_time() -> None:
    metrics = ServerMetrics()
    counts = BatchingCounts(
        running=3,
        waiting=2,
        batch_sizes=[0, 5, 1, 0, 4, 0, 2],  # steps by batch size, up to parallel = 6
        prefill_tokens=120,
        cached_prompt_tokens=30,
        decode_tokens=42,
    )
    metrics.watch_batching(lambda: counts)
    text = metrics.render().decode()
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
    metrics = ServerMetrics()
    metrics.watch_batching(lambda: BatchingCounts(0, 0, [0, 7], 0, 0, 0))
    text = metrics.render().decode()
    assert sample(text, 'llm_pipeline_llama_batch_size_bucket{le="1.0"}') == 7
    assert sample(text, "llm_pipeline_llama_batch_size_sum") == 7
