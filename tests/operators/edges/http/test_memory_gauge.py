"""``llm_pipeline_python_allocated_blocks``: what a leak of small objects shows on
``/metrics`` while resident memory does not (``tests/operators/cli/test_cli_memory.py``)."""

from __future__ import annotations

import re

from operators.edges.http.metrics import ServerMetrics

_SAMPLE = re.compile(r"^llm_pipeline_python_allocated_blocks (\S+)$", re.MULTILINE)


def allocated_blocks(metrics: ServerMetrics) -> float:
    match = _SAMPLE.search(metrics.render().decode())
    assert match is not None, "no llm_pipeline_python_allocated_blocks sample"
    return float(match[1])


def test_the_gauge_follows_the_objects_alive_at_scrape_time() -> None:
    """A block per object kept, give or take what the scrape itself allocates."""
    metrics = ServerMetrics()
    before = allocated_blocks(metrics)
    kept = [object() for _ in range(10_000)]
    during = allocated_blocks(metrics)
    del kept
    after = allocated_blocks(metrics)
    assert during - before > 9_000
    assert during - after > 9_000
