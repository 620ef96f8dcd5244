"""The routing policy ``serve --router`` asks for over its in-process workers.

``kv`` builds one :class:`~pipeline.prefix_index.PrefixIndex` for the worker set and feeds
it in-process: each mocker's cache reports its KV events to a sink that applies them under
the worker's id (no transport: the events are applied synchronously, on the loop that
routes). When some worker's engine reports nothing (echo, a user's engine), the router
approximates instead: it assumes a worker caches what it sent there, and the index is fed
by the router alone (mixing both would let the router's guesses and the events fight).

Over NATS (``serve --nats --router kv``) the workers live elsewhere: their KV events come
over NATS into an index per worker set (``operators.cli.nats.follow_kv_events``), so the
router is always in events mode; a worker that publishes none (an echo worker, a mocker
without ``--mocker-cache-blocks``) holds nothing in the index and is chosen by load alone.
Its retries avoid the workers a request already tried, as the round-robin one does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from operators.routing.kv_policy import llm_kv_router
from pipeline import (
    KvEvent,
    KvEventSink,
    KvRouter,
    LeastLoaded,
    PrefixIndex,
    Random,
    RoundRobin,
    Worker,
    WorkerLoad,
    WorkerSet,
)

if TYPE_CHECKING:
    from operators.edges.http.metrics import ServerMetrics
    from pipeline.routers import RoutingPolicy

    from .config import ServeConfig

__all__ = ("Report", "kv_router", "remote_kv_policy", "routing_policy", "upstream_policy")

#: where a KV router reads a worker's own report of its load
Report = Callable[[Worker[Any, Any]], WorkerLoad | None]


def routing_policy(
    config: ServeConfig, workers: WorkerSet[Any, Any], metrics: ServerMetrics | None = None
) -> RoutingPolicy:
    """The policy ``config.router`` names over ``workers``; ``kv`` weighs each worker's
    load as its engine reports it (``load_report()``) and counts its decisions in
    ``metrics`` (hit and miss blocks, decisions per worker)."""
    name = config.router
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "least-loaded":
        return LeastLoaded()
    index = PrefixIndex()
    reporting = all(_listen(index, worker.id, worker.engine) for worker in workers.members)
    if not reporting:
        for worker in workers.members:  # the router's own beliefs only
            if hasattr(worker.engine, "kv_events"):
                worker.engine.kv_events = None
            index.remove_worker(worker.id)
    else:  # members that join later (an upstream that came up) report too
        workers.listen(_joiner(index, workers))
    return kv_router(config, index, metrics, approximate=not reporting)


def upstream_policy(
    config: ServeConfig, workers: WorkerSet[Any, Any], metrics: ServerMetrics | None = None
) -> RoutingPolicy:
    """The policy over ``--engine remote``'s upstreams: ``config.router``'s (under ``kv``,
    weighing each upstream's load as its server reports it), retrying elsewhere."""
    from operators.contracts.retry_elsewhere import RetryElsewhere

    return RetryElsewhere(routing_policy(config, workers, metrics))


def remote_kv_policy(
    config: ServeConfig,
    index: PrefixIndex,
    metrics: ServerMetrics | None = None,
    report: Report | None = None,
) -> RoutingPolicy:
    """``--router kv`` over discovered workers: a KvRouter reading ``index`` (fed by the
    workers' KV events over NATS) and ``report`` (their load reports, over NATS too) among
    the workers a request has not tried yet."""
    from operators.contracts.retry_elsewhere import RetryElsewhere

    return RetryElsewhere(kv_router(config, index, metrics, approximate=False, report=report))


def kv_router(
    config: ServeConfig,
    index: PrefixIndex,
    metrics: ServerMetrics | None,
    *,
    approximate: bool,
    report: Report | None = None,
) -> KvRouter:
    """The KV router ``config`` asks for over ``index``; ``report`` reads a worker's load
    report (None: its engine's ``load_report()``)."""
    options: dict[str, Any] = {} if report is None else {"report": report}
    return llm_kv_router(
        index,
        block_size=config.engine.kv_block_size,
        overlap_weight=config.kv_overlap_weight,
        restore_cost=config.kv_restore_cost,
        decode_weight=config.kv_decode_weight,
        balance=config.router_balance,
        temperature=config.router_temperature,
        affinity_ttl=config.affinity_ttl,
        approximate=approximate,
        on_decision=None if metrics is None else metrics.count_kv_decision,
        **options,
    )


def _joiner(index: PrefixIndex, workers: WorkerSet[Any, Any]) -> Callable[[str, bool], None]:
    """A membership listener that feeds a joining worker's KV events into ``index``."""

    def joined(worker_id: str, joined: bool) -> None:
        worker = workers.get(worker_id)
        if joined and worker is not None:
            _listen(index, worker_id, worker.engine)

    return joined


def _listen(index: PrefixIndex, worker_id: str, engine: Any) -> bool:
    """Feed ``engine``'s KV events into ``index`` as ``worker_id``'s; False: it has none."""
    if not hasattr(engine, "kv_snapshot"):
        return False
    engine.kv_events = _sink(index, worker_id, engine)
    if engine.kv_events is None:  # the engine took no sink: its cache is off
        return False
    index.apply(worker_id, engine.kv_snapshot())
    return True


def _sink(index: PrefixIndex, worker_id: str, engine: Any) -> KvEventSink:
    def apply(event: KvEvent) -> None:
        # In-process nothing is lost; a gap would still be repaired by a fresh snapshot.
        if not index.apply(worker_id, event):
            index.apply(worker_id, engine.kv_snapshot())

    return apply
