"""vLLM's scheduler statistics, kept for our ``/metrics`` instead of vLLM's own Prometheus.

vLLM reports its scheduler's state (running and waiting requests, KV cache usage, prefix
cache queries and hits) once per engine step to "stat loggers" in the frontend process. By
default it adds a Prometheus logger of its own, whose per-token histograms cost CPU that
on a small machine is taken from the engine; ours only keeps the last values, read when
``/metrics`` is scraped. It declares itself a Prometheus logger so that vLLM adds none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, final

__all__ = ("SchedulerCounts", "VllmStatistics", "stat_logger_class")


class VllmStatistics(NamedTuple):
    """Counters and gauges of a :class:`VllmEngine` (counters since it was created)."""

    #: requests that reached vLLM (refused ones are not counted)
    requests: int
    #: prompt tokens of those requests (once per request, also for n > 1)
    prompt_tokens: int
    #: tokens generated, over all choices
    generated_tokens: int
    #: prompt tokens vLLM found in its prefix cache
    cached_prompt_tokens: int
    #: requests (choices) vLLM is running now, as of its last step
    running_requests: int = 0
    #: requests (choices) waiting for room in vLLM's batch or KV cache
    waiting_requests: int = 0
    #: the fraction of vLLM's KV cache blocks in use (0..1)
    kv_cache_usage: float = 0.0
    #: prompt tokens vLLM looked up in its prefix cache, and found there
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: requests vLLM preempted (their KV was dropped for room and recomputed later)
    preemptions: int = 0


@final
@dataclass(slots=True)
class SchedulerCounts:
    """The last scheduler statistics vLLM reported (gauges), and the prefix cache's totals."""

    running: int = 0
    waiting: int = 0
    #: the fraction of KV cache blocks in use (0..1)
    kv_cache_usage: float = 0.0
    #: prompt tokens looked up in the prefix cache, and found there (since start)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    #: the steps reported (the engine core's progress, whatever it outputs)
    steps: int = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """One engine step's statistics (either may be None)."""
        self.steps += 1
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.prefix_cache_queries += prefix.queries
                self.prefix_cache_hits += prefix.hits
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs


def stat_logger_class(counts: SchedulerCounts) -> type:
    """A vLLM stat logger class (vLLM instantiates it) recording into ``counts``."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class Recorder(PrometheusStatLogger):  # type: ignore[misc]
        """Replaces vLLM's Prometheus logger (it is one, by type): records, exports nothing."""

        def __init__(self, vllm_config: Any, engine_indexes: Any = None) -> None:
            pass  # (no Prometheus collectors: /metrics is ours)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            counts.record(scheduler_stats, iteration_stats)

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def log(self) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return Recorder
