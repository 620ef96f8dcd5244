"""The probes an orchestrator asks, by Kubernetes' conventions: ``/live``, ``/ready``,
``/health``, and the health series of ``/metrics``.

Every answer reads one :class:`pipeline.health.Health` (the app's ``health``) and whether
the app drains; none is guarded (probes carry no credentials) and none runs the graph::

    GET /live    200 while the process can serve; 503 once an engine it hosts is dead
                 beyond recovery (the orchestrator should restart it)
    GET /ready   200 when every served model has an engine or worker that is up and making
                 progress; 503 during start-up, drain, a stall, a restart or with no
                 workers, the body naming each model's state and why
    GET /health  the process itself, told truthfully: 503 while draining or while an
                 engine it hosts is starting, stalled, failing, restarting or dead

Series (:class:`HealthMetrics`)::

    llm_pipeline_engine_ready{model}          gauge, 1 while the model is ready
    llm_pipeline_engine_stalls_total{model}   counter, stalls of the engines hosted here
    llm_pipeline_engine_restarts_total{model} counter, rebuilds of the engines hosted here
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, final

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.health import Health, Supervised

if TYPE_CHECKING:
    from .models import ServedModel

__all__ = ("PROBES", "HealthMetrics", "health_answer", "live_answer", "ready_answer")

#: the paths answered here
PROBES = frozenset({"/live", "/ready", "/health"})

_Answer = tuple[int, bytes]


def live_answer(health: Health) -> _Answer:
    """``/live``: 503 once an engine hosted here is dead beyond recovery."""
    dead = health.dead
    if dead is None:
        return 200, b'{"status":"live"}'
    return 503, orjson.dumps({"status": "dead", "reason": dead})


def ready_answer(health: Health, models: Iterable[ServedModel], *, draining: bool) -> _Answer:
    """``/ready``: 200 when every model served has an engine or worker up; the body says
    each model's state and why (an adapter is as ready as its base model)."""
    states: dict[str, dict[str, Any]] = {}
    for model in models:
        if model.parent is not None:
            continue
        told = health.model(model.name)
        if told is None or told.ready:
            states[model.name] = {"ready": True}
        else:
            states[model.name] = {"ready": False, "reason": told.reason}
    body: dict[str, Any] = {"status": "ready", "models": states}
    if draining:
        body["reason"] = "draining"
    elif not health.live:
        body["reason"] = f"not live: {health.dead}"
    elif not states:
        body["reason"] = "no model is served yet"
    ready = "reason" not in body and all(state["ready"] for state in states.values())
    if not ready:
        body["status"] = "not_ready"
    return (200 if ready else 503), orjson.dumps(body)


def health_answer(health: Health, *, draining: bool) -> _Answer:
    """``/health``: the process itself; 503 while draining or while an engine it hosts is
    not in health (a frontend with no workers yet is healthy, only not ready)."""
    if draining:
        return 503, b'{"status":"draining"}'
    trouble = health.trouble()
    if trouble is None:
        return 200, b'{"status":"ok"}'
    return 503, orjson.dumps({"status": "unhealthy", "reason": trouble})


@final
class HealthMetrics(Collector):
    """The health series, read from ``health`` at scrape time."""

    def __init__(self, health: Health) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        """One sample per model told (counters only for models with engines hosted here)."""
        health = self._health
        ready = GaugeMetricFamily(
            "llm_pipeline_engine_ready",
            "1 while the model has an engine or worker that takes requests",
            labels=["model"],
        )
        stalls = CounterMetricFamily(
            "llm_pipeline_engine_stalls",
            "Stalls of the model's engines hosted here (no progress with requests waiting)",
            labels=["model"],
        )
        restarts = CounterMetricFamily(
            "llm_pipeline_engine_restarts",
            "Rebuilds of the model's engines hosted here after they died",
            labels=["model"],
        )
        for name in health.names:
            told = health.model(name)
            ready.add_metric([name], 1.0 if told is None or told.ready else 0.0)
            hosted = [s for s in health.sources(name) if isinstance(s, Supervised)]
            if hosted:
                stalls.add_metric([name], float(sum(engine.stalls for engine in hosted)))
                restarts.add_metric([name], float(sum(engine.restarts for engine in hosted)))
        yield ready
        yield stalls
        yield restarts
