"""The planner's loop: inputs from NATS, a decision per pool every interval, carried out.

::

    frontends --{ns}.planner.latency--> latency of each model (p90 TTFT, ITL) --+
    workers ---{ns}.kv.*.* (load)-----> LoadAverages: each pool's load averaged --+--> decide()
    discovery (JetStream KV) ---------> workers serving, per pool --------------+      |
    KV events ------------------------> PrefixIndex: blocks only a worker holds        |
                                                                                        v
    a step down: drain_worker(chosen) over NATS, then connector.scale_to(n, leaving=[chosen])
    a step up:   connector.scale_to(n)            status -> {ns}.planner.status, /metrics

A *pool* is a model's workers in one role (aggregated, or prefill and decode when they are
disaggregated). Each pool answers for the latencies its role controls: a prefill pool the
TTFT, a decode pool the inter-token latency, an aggregated pool both; its load is requests
in flight (a prefill pool's: prompt tokens queued, the work a prefill worker has).

The worker to drain is the planner's own worker that is not serving yet, if there is one
(it has nothing to lose), else the serving one with the least work in flight, then the
fewest KV blocks no other worker holds (the planner follows the KV events too), then the
newest. Workers someone else started count as serving (they take load), but the planner
never drains them.

Readiness: a worker counts as serving once discovery shows it. Frontends route to exactly
those, and a worker registers ready only once its engine answered a one-token probe
(:mod:`pipeline.health`, ``first_probe``), so one the planner started takes requests, and
counts as serving, only once it works.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import orjson
from anyio.abc import TaskStatus

from pipeline import PrefixIndex, WorkerSet
from pipeline.transports.nats import (
    NatsDiscovery,
    NatsKvEvents,
    NatsLoads,
    drain_worker,
)

from .latency import LatencyWindows
from .load_averages import LoadAverages
from .metrics import PlannerMetrics
from .policy import Decision, Learned, Observation, Policy, decide, drain_order
from .pools import PlannedPool
from .wire import KINDS, decode_summary, latency_subject, status_subject

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from .connector import Connector

__all__ = ("Planner",)

logger = logging.getLogger("operators.planner")

#: the last changes of each pool the status document keeps
_HISTORY: Final = 10


@final
class _PoolState:
    """What the planner keeps of one pool between rounds."""

    __slots__ = (
        "changed_at",
        "history",
        "index",
        "last",
        "learned",
        "observed",
        "ours",
        "policy",
        "pool",
        "target",
        "workers",
    )

    def __init__(self, pool: PlannedPool) -> None:
        self.pool = pool
        #: the policy with the targets of this pool's role
        self.policy = Policy(
            targets=pool.targets,
            min_workers=pool.policy.min_workers,
            max_workers=pool.policy.max_workers,
            headroom=pool.policy.headroom,
            cooldown=pool.policy.cooldown,
            memory=pool.policy.memory,
        )
        self.workers: WorkerSet[Any, Any] = WorkerSet(f"{pool.model} {pool.role}")
        self.index = PrefixIndex()
        self.learned = Learned()
        #: the planner's own workers it asked the connector for
        self.target = 0
        self.last: Decision | None = None
        self.observed: tuple[float | None, float | None, float | None] = (None, None, None)
        self.history: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        #: when a worker last joined or left the serving set (anyio's clock)
        self.changed_at = -math.inf
        #: the ids of the workers the connector runs or ran that are still registered
        self.ours: set[str] = set()


@final
class Planner:
    """Plans ``pools`` through ``connector`` every ``interval`` seconds (see the module
    docstring): ``await task_group.start(planner.run)``."""

    def __init__(
        self,
        nc: Client,
        pools: Sequence[PlannedPool],
        connector: Connector,
        *,
        interval: float,
        namespace: str,
        metrics: PlannerMetrics | None = None,
    ) -> None:
        if not pools:
            raise ValueError("nothing to plan: give at least one pool")
        seen = {(pool.model, pool.role) for pool in pools}
        if len(seen) != len(pools):
            raise ValueError("a pool (model and role) is given twice")
        if not interval > 0:
            raise ValueError(f"the interval must be > 0 seconds, got {interval!r}")
        self._nc = nc
        self._pools = [_PoolState(pool) for pool in pools]
        self._connector = connector
        self._interval = interval
        self._namespace = namespace
        self.metrics = metrics if metrics is not None else PlannerMetrics()
        self._averages = LoadAverages()
        self._latencies = LatencyWindows()
        self._loads = NatsLoads(nc, self._on_load, namespace=namespace)
        self._rounds = 0
        for state in self._pools:
            self.metrics.add_pool(state.pool.model, state.pool.role, state.policy)

    # -- running

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow the inputs and plan until cancelled; ``task_status`` is told once the
        inputs are followed and the first round (bringing each pool to its minimum) ran."""
        async with anyio.create_task_group() as tg:
            subscription = await self._nc.subscribe(
                latency_subject(self._namespace), cb=self._on_latency
            )
            try:
                await tg.start(self._loads.run)
                for state in self._pools:
                    await self._follow(tg, state)
                await self._round()
                task_status.started()
                while True:
                    await anyio.sleep(self._interval)
                    await self._round()
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    await subscription.unsubscribe()
                tg.cancel_scope.cancel()

    async def _follow(self, tg: anyio.abc.TaskGroup, state: _PoolState) -> None:
        """Follow a pool's discovery and KV events; ask each worker that joins for its load."""
        model, role = state.pool.model, state.pool.role
        discovery: NatsDiscovery[Any, Any] = NatsDiscovery(
            self._nc, model=model, role=role, namespace=self._namespace
        )

        def joined(worker_id: str, joined: bool) -> None:
            state.changed_at = anyio.current_time()
            if joined:
                if not self._averages.knows(worker_id):
                    tg.start_soon(self._loads.ask, model, worker_id)
            else:
                self._averages.forget(worker_id)

        state.workers.listen(joined)
        await tg.start(discovery.run, state.workers)
        for worker in state.workers.members:
            joined(worker.id, True)
        kv_events = NatsKvEvents(
            self._nc, model=model, index=state.index, namespace=self._namespace
        )
        await tg.start(kv_events.run, state.workers)

    def _on_load(self, worker_id: str, load: Mapping[str, Any]) -> None:
        self._averages.report(worker_id, load, anyio.current_time())

    async def _on_latency(self, msg: Msg) -> None:
        try:
            summary = decode_summary(msg.data)
        except ValueError as exc:
            logger.warning("planner: ignoring a latency summary: %s", exc)
            return
        for model, kinds in summary.items():
            for kind, buckets in kinds.items():
                self._latencies.add(model, kind, buckets)

    # -- one round

    async def _round(self) -> None:
        now = anyio.current_time()
        latencies = self._latencies.judge()
        self._rounds += 1
        for state in self._pools:
            measured = latencies.get(state.pool.model, {})
            try:
                await self._plan(state, now, measured)
            except Exception:  # a connector that failed: the next round tries again
                logger.exception(
                    "planner: planning %s (%s) failed", state.pool.model, state.pool.role
                )
        await self._publish_status()

    async def _plan(self, state: _PoolState, now: float, measured: Mapping[str, float]) -> None:
        pool = state.pool
        managed = [
            w for w in self._connector.list() if (w.model, w.role) == (pool.model, pool.role)
        ]
        own = [w.worker_id for w in managed if w.state != "leaving"]
        registered = [worker.id for worker in state.workers.members]
        # A worker of ours no longer running (leaving, or dead with its key not expired
        # yet) serves nobody; one never ours is someone else's, and serves.
        state.ours = state.ours.intersection(registered).union(w.worker_id for w in managed)
        serving = [wid for wid in registered if wid in own or wid not in state.ours]
        external = len(set(serving).difference(own))
        numbers = self._averages.take(serving, now)
        load = None if numbers is None else pool.load(numbers)
        ttft, itl = (measured.get(kind) for kind in KINDS)
        targets = state.policy.targets
        seen = Observation(
            now=now,
            workers=len(serving),
            target=state.target + external,
            load=load,
            ttft_p90=ttft if targets.ttft_p90 is not None else None,
            itl_p90=itl if targets.itl_p90 is not None else None,
            settled=now - state.changed_at >= self._interval,
        )
        decision, state.learned = decide(state.policy, state.learned, seen)
        state.last = decision
        state.observed = (load, ttft, itl)
        wanted = max(decision.target - external, 0)
        _log(pool, decision, seen, ttft, itl)
        if wanted != state.target:
            await self._scale(state, wanted, serving, own)
            state.history.appendleft(
                {
                    "at": time.time(),
                    "from": decision.previous,
                    "to": decision.target,
                    "reason": decision.reason,
                }
            )
        self.metrics.decided(
            pool.model,
            pool.role,
            decision,
            serving=len(serving),
            load=load,
            ttft_p90=ttft,
            itl_p90=itl,
        )

    async def _scale(
        self, state: _PoolState, wanted: int, serving: list[str], own: list[str]
    ) -> None:
        pool = state.pool
        if wanted > state.target:
            await self._connector.scale_to(pool.model, pool.role, wanted)
            state.target = wanted
            return
        leaving = self._choose(state, serving, own, state.target - wanted)
        for worker_id in leaving:
            if worker_id in serving and not await drain_worker(
                self._nc, worker_id, namespace=self._namespace
            ):
                logger.warning(
                    "planner: worker %s of %r (%s) did not acknowledge the drain (the connector "
                    "stops it)",
                    worker_id,
                    pool.model,
                    pool.role,
                )
        await self._connector.scale_to(pool.model, pool.role, wanted, leaving=leaving)
        state.target = wanted

    def _choose(
        self, state: _PoolState, serving: list[str], own: list[str], count: int
    ) -> list[str]:
        """The ``count`` own workers to go (:func:`~.policy.drain_order`)."""
        averages = self._averages

        def in_flight(worker_id: str) -> float:
            now = averages.now(worker_id)
            return now.get("waiting", 0.0) + now.get("decoding", 0.0)

        return drain_order(own, set(serving), in_flight, state.index.unique_blocks)[:count]

    # -- what it says about itself

    def status(self) -> dict[str, Any]:
        """The status document (also published on ``{ns}.planner.status``): each pool's
        targets, bounds, workers, load, learned capacity, observed latencies, last changes
        and the workers its connector runs (restarts, what it last said of each)."""
        pools = []
        managed = self._connector.list()
        for state in self._pools:
            policy, last = state.policy, state.last
            load, ttft, itl = state.observed
            mine = [w for w in managed if (w.model, w.role) == (state.pool.model, state.pool.role)]
            pools.append(
                {
                    "model": state.pool.model,
                    "role": state.pool.role,
                    "targets": {
                        "ttft_p90_ms": _ms(policy.targets.ttft_p90),
                        "itl_p90_ms": _ms(policy.targets.itl_p90),
                    },
                    "min_workers": policy.min_workers,
                    "max_workers": policy.max_workers,
                    "workers": state.target,
                    "serving": len(state.workers),
                    "load": None if load is None else round(load, 3),
                    "capacity": None
                    if last is None or last.capacity is None
                    else round(last.capacity, 3),
                    "observed": {"ttft_p90_ms": _ms(ttft), "itl_p90_ms": _ms(itl)},
                    "last": None
                    if last is None
                    else {"reason": last.reason, "verdict": last.verdict},
                    "changes": list(state.history),
                    "managed": [
                        {
                            "id": w.worker_id,
                            "state": w.state,
                            "restarts": w.restarts,
                            "detail": w.detail,
                        }
                        for w in mine
                    ],
                }
            )
        return {
            "interval_s": self._interval,
            "at": time.time(),
            "rounds": self._rounds,
            "pools": pools,
        }

    async def _publish_status(self) -> None:
        try:
            await self._nc.publish(status_subject(self._namespace), orjson.dumps(self.status()))
        except Exception as exc:  # nats-py's errors: a connection closing or down
            logger.debug("planner: status not published: %r", exc)

    def __repr__(self) -> str:
        pools = ", ".join(f"{s.pool.model}/{s.pool.role}" for s in self._pools)
        return f"Planner({pools})"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else round(seconds * 1000, 1)


def _log(
    pool: PlannedPool, decision: Decision, seen: Observation, ttft: float | None, itl: float | None
) -> None:
    """One line per pool and round: what it saw, what it decided, why."""
    change = (
        f"{decision.previous} -> {decision.target} workers"
        if decision.step
        else f"{decision.target} workers"
    )
    load = "unknown" if seen.load is None else f"{seen.load:.2f}"
    capacity = "?" if decision.capacity is None else f"{decision.capacity:.2f}"
    targets = pool.policy.targets
    logger.log(
        logging.INFO,
        "planner: %s (%s): %s (%s): %d serving, load %s, capacity %s per worker, "
        "ttft p90 %s (target %s), itl p90 %s (target %s)",
        pool.model,
        pool.role,
        change,
        decision.reason,
        seen.workers,
        load,
        capacity,
        _text(ttft),
        _text(targets.ttft_p90),
        _text(itl),
        _text(targets.itl_p90),
    )


def _text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
