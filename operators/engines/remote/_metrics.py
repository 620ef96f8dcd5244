"""The upstreams' Prometheus series, read from their engines when ``/metrics`` is scraped.

Registered into the server's registry the way the vLLM engine's ``llm_pipeline_vllm_*``
series are (``operators.cli.engines.watch_upstreams``): a collector that costs nothing
between scrapes. One child per upstream (label ``upstream``: ``host:port``)::

    llm_pipeline_upstream_up{upstream}                     gauge, 1 while it answers
    llm_pipeline_upstream_requests_total{upstream}         counter, requests routed to it
    llm_pipeline_upstream_lost_total{upstream}             counter, requests it lost
    llm_pipeline_upstream_generated_tokens_total{upstream} counter, tokens it generated
    llm_pipeline_upstream_cached_prompt_tokens_total{upstream}  counter, prompt tokens it
                                                           reported found in its cache
    llm_pipeline_upstream_running_requests{upstream}       gauge, as it last reported
    llm_pipeline_upstream_waiting_requests{upstream}       gauge, as it last reported
    llm_pipeline_upstream_kv_cache_usage_ratio{upstream}   gauge, as it last reported (vLLM)

What a router makes of the reports (prompt tokens, with its own requests) is
``llm_pipeline_router_*`` (:mod:`operators.telemetry.router_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .engine import RemoteEngine

__all__ = ("UpstreamCollector",)

_LABELS = ["upstream"]


class UpstreamCollector(Collector):
    """The ``llm_pipeline_upstream_*`` series of the engines ``engines()`` returns (read at
    each scrape: upstreams that join later are included)."""

    def __init__(self, engines: Callable[[], Iterable[RemoteEngine]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        name = "llm_pipeline_upstream"
        up = GaugeMetricFamily(f"{name}_up", "1 while the upstream answers.", labels=_LABELS)
        requests = CounterMetricFamily(
            f"{name}_requests", "Requests routed to the upstream.", labels=_LABELS
        )
        lost = CounterMetricFamily(
            f"{name}_lost",
            "Requests the upstream lost (unreachable, a broken stream, a 5xx): retried elsewhere.",
            labels=_LABELS,
        )
        generated = CounterMetricFamily(
            f"{name}_generated_tokens", "Tokens the upstream generated.", labels=_LABELS
        )
        cached = CounterMetricFamily(
            f"{name}_cached_prompt_tokens",
            "Prompt tokens the upstream reported finding in its prefix cache.",
            labels=_LABELS,
        )
        running = GaugeMetricFamily(
            f"{name}_running_requests",
            "Requests the upstream runs, as it last said.",
            labels=_LABELS,
        )
        waiting = GaugeMetricFamily(
            f"{name}_waiting_requests",
            "Requests waiting in the upstream's queue, as it last said.",
            labels=_LABELS,
        )
        usage = GaugeMetricFamily(
            f"{name}_kv_cache_usage_ratio",
            "Fraction of the upstream's KV cache in use, as it last said (vLLM).",
            labels=_LABELS,
        )
        for engine in self._engines():
            label = [engine.name]
            stats = engine.statistics()
            up.add_metric(label, 1.0 if stats.up else 0.0)
            requests.add_metric(label, stats.requests)
            lost.add_metric(label, stats.lost)
            generated.add_metric(label, stats.generated_tokens)
            cached.add_metric(label, stats.cached_prompt_tokens)
            report = stats.load
            if report is not None:
                running.add_metric(label, report.running)
                waiting.add_metric(label, report.waiting)
                if report.kv_cache_usage is not None:
                    usage.add_metric(label, report.kv_cache_usage)
        yield from (up, requests, lost, generated, cached, running, waiting, usage)

    def describe(self) -> Iterator[Metric]:
        return iter(())
