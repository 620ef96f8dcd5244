"""What the routers make of their workers, per worker: the ``llm_pipeline_router_*`` series.

Read at scrape time from the worker sets the server routes over (nothing is counted on the
routing path but what the ledger keeps anyway): each member's ledger (requests routed to
it), its own last load report (:class:`pipeline.WorkerLoad`), and, under a KV router, the
load that router weighs it by (its report and the router's own requests, in prompt
tokens)::

    llm_pipeline_router_requests_total{set,worker}             counter, requests routed to it
    llm_pipeline_router_in_flight_requests{set,worker}         gauge, of those, streaming now
    llm_pipeline_router_weighed_load_tokens{set,worker}        gauge, what the KV router
                                                               weighs it by (prompt tokens)
    llm_pipeline_router_reported_prefill_tokens{set,worker}    gauge, prompt tokens it says
                                                               it has queued
    llm_pipeline_router_reported_sequences{set,worker}         gauge, sequences it says it
                                                               holds (decoding or starting)
    llm_pipeline_router_reported_kv_usage_ratio{set,worker}    gauge, its KV cache in use

The KV hits per worker are counted as decisions are made (``llm_pipeline_router_hit_blocks
_total{worker}``, :class:`operators.edges.http.metrics.ServerMetrics`). One collector per
registry, however many worker sets and models (:func:`watch_routers`): two would write the
same families twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, final

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline import Worker, WorkerLoad, WorkerSet

__all__ = ("RouterCollector", "watch_routers")

_LABELS = ["set", "worker"]

#: what a KV router weighs a worker by (``KvRouter.work``), and its report (``.report``)
Weigh = Callable[[Worker[Any, Any]], float]
Report = Callable[[Worker[Any, Any]], WorkerLoad | None]

_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, RouterCollector] = (
    weakref.WeakKeyDictionary()
)


def _engine_report(worker: Worker[Any, Any]) -> WorkerLoad | None:
    load_report = getattr(worker.engine, "load_report", None)
    report = load_report() if load_report is not None else None
    return report if isinstance(report, WorkerLoad) else None


@final
class RouterCollector(Collector):
    """The ``llm_pipeline_router_*`` series of the worker sets it watches."""

    def __init__(self) -> None:
        self._sets: dict[str, tuple[WorkerSet[Any, Any], Weigh | None, Report]] = {}

    def watch(
        self,
        workers: WorkerSet[Any, Any],
        weigh: Weigh | None = None,
        report: Report | None = None,
        *,
        label: str | None = None,
    ) -> None:
        """Report on ``workers`` (labelled ``label``, default the set's name); ``weigh``: the
        KV router's load of a worker, ``report``: where its own reports are read (default:
        its engine's ``load_report()``)."""
        self._sets[label or workers.name] = (workers, weigh, report or _engine_report)

    def collect(self) -> Iterator[Metric]:
        name = "llm_pipeline_router"
        routed = CounterMetricFamily(
            f"{name}_requests", "Requests routed to the worker.", labels=_LABELS
        )
        flying = GaugeMetricFamily(
            f"{name}_in_flight_requests", "Requests routed to it, streaming now.", labels=_LABELS
        )
        weighed = GaugeMetricFamily(
            f"{name}_weighed_load_tokens",
            "The worker's load as the KV router weighs it, in prompt tokens of prefill.",
            labels=_LABELS,
        )
        prefill = GaugeMetricFamily(
            f"{name}_reported_prefill_tokens",
            "Prompt tokens the worker last said it has queued for prefill.",
            labels=_LABELS,
        )
        sequences = GaugeMetricFamily(
            f"{name}_reported_sequences",
            "Sequences the worker last said it holds (decoding or before their first token).",
            labels=_LABELS,
        )
        usage = GaugeMetricFamily(
            f"{name}_reported_kv_usage_ratio",
            "The fraction of its KV cache the worker last said is in use.",
            labels=_LABELS,
        )
        for label, (workers, weigh, report_of) in list(self._sets.items()):
            for worker in workers.members:
                labels = [label, worker.id]
                routed.add_metric(labels, worker.ledger.sent_total)
                flying.add_metric(labels, worker.in_flight)
                if weigh is not None:
                    weighed.add_metric(labels, weigh(worker))
                report = report_of(worker)
                if report is not None:
                    prefill.add_metric(labels, report.prefill_tokens)
                    sequences.add_metric(labels, report.decoding + report.waiting)
                    if report.kv_usage is not None:
                        usage.add_metric(labels, report.kv_usage)
        yield from (routed, flying, weighed, prefill, sequences, usage)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def watch_routers(registry: CollectorRegistry) -> RouterCollector:
    """The registry's router collector (registered on first use)."""
    collector = _COLLECTORS.get(registry)
    if collector is None:
        collector = _COLLECTORS[registry] = RouterCollector()
        registry.register(collector)
    return collector
