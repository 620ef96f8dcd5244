"""The planner's Prometheus series (its own ``/metrics``), in a registry of its own.

::

    llm_pipeline_planner_workers{model, role}                  gauge, workers asked for
    llm_pipeline_planner_serving_workers{model, role}          gauge, ready in discovery
    llm_pipeline_planner_decisions_total{model, role, reason}  counter, one per pool and round
    llm_pipeline_planner_scale_events_total{model, role, direction}  counter, up or down
    llm_pipeline_planner_latency_p90_seconds{model, role, latency}   gauge, observed (NaN:
                                                               too few requests measured)
    llm_pipeline_planner_target_p90_seconds{model, role, latency}    gauge, the target
    llm_pipeline_planner_load{model, role}                     gauge, averaged over the round
    llm_pipeline_planner_capacity{model, role}                 gauge, learned, per worker
                                                               (NaN: not learned yet)
    llm_pipeline_planner_worker_restarts_total{model, role}    counter, crashed workers
                                                               restarted (local connector)

``latency`` is ``ttft`` or ``itl``; ``reason`` one of :data:`.policy.REASONS`.
"""

from __future__ import annotations

import math
from typing import Final, final

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .policy import REASONS, Decision, Policy

__all__ = ("CONTENT_TYPE", "PlannerMetrics")

#: the Content-Type of :meth:`PlannerMetrics.render`'s output
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


@final
class PlannerMetrics:
    """The planner's series, in ``registry`` (a fresh one when not given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        pool = ["model", "role"]
        self.workers = Gauge(
            "llm_pipeline_planner_workers",
            "Workers the planner asked for, by model and role (those starting included).",
            pool,
            registry=self.registry,
        )
        self.serving = Gauge(
            "llm_pipeline_planner_serving_workers",
            "Workers ready in discovery, by model and role.",
            pool,
            registry=self.registry,
        )
        self.decisions = Counter(
            "llm_pipeline_planner_decisions",
            "Decisions, one per pool every --interval, by why they are what they are.",
            [*pool, "reason"],
            registry=self.registry,
        )
        self.scale_events = Counter(
            "llm_pipeline_planner_scale_events",
            "Changes of a pool's size, by direction (up, down).",
            [*pool, "direction"],
            registry=self.registry,
        )
        self.latency = Gauge(
            "llm_pipeline_planner_latency_p90_seconds",
            "The p90 the frontends measured over the last round (NaN: too few requests).",
            [*pool, "latency"],
            registry=self.registry,
        )
        self.target = Gauge(
            "llm_pipeline_planner_target_p90_seconds",
            "The p90 targets of each pool.",
            [*pool, "latency"],
            registry=self.registry,
        )
        self.load = Gauge(
            "llm_pipeline_planner_load",
            "A pool's load over the last round: requests in flight (prefill pools: prompt "
            "tokens queued), averaged.",
            pool,
            registry=self.registry,
        )
        self.capacity = Gauge(
            "llm_pipeline_planner_capacity",
            "The learned load per worker at which the targets hold (NaN: not learned yet).",
            pool,
            registry=self.registry,
        )
        self.restarts = Counter(
            "llm_pipeline_planner_worker_restarts",
            "Workers restarted after they crashed or failed to start.",
            pool,
            registry=self.registry,
        )

    def add_pool(self, model: str, role: str, policy: Policy) -> None:
        """Show a pool's series from the start (its targets, zero decisions)."""
        for latency, target in (("ttft", policy.targets.ttft_p90), ("itl", policy.targets.itl_p90)):
            if target is not None:
                self.target.labels(model, role, latency).set(target)
                self.latency.labels(model, role, latency).set(math.nan)
        for reason in REASONS:
            self.decisions.labels(model, role, reason)
        for direction in ("up", "down"):
            self.scale_events.labels(model, role, direction)
        self.restarts.labels(model, role)
        self.capacity.labels(model, role).set(math.nan)

    def decided(
        self,
        model: str,
        role: str,
        decision: Decision,
        *,
        serving: int,
        load: float | None,
        ttft_p90: float | None,
        itl_p90: float | None,
    ) -> None:
        """Record one round of a pool."""
        self.decisions.labels(model, role, decision.reason).inc()
        if decision.step:
            direction = "up" if decision.step > 0 else "down"
            self.scale_events.labels(model, role, direction).inc()
        self.workers.labels(model, role).set(decision.target)
        self.serving.labels(model, role).set(serving)
        self.load.labels(model, role).set(_nan(load))
        self.capacity.labels(model, role).set(_nan(decision.capacity))
        for latency, value in (("ttft", ttft_p90), ("itl", itl_p90)):
            self.latency.labels(model, role, latency).set(_nan(value))

    def restarted(self, model: str, role: str) -> None:
        """Count a worker restart (the local connector's ``on_restart``)."""
        self.restarts.labels(model, role).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition (see :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
