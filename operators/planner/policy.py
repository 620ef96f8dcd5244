"""The planner's decision rule, as a pure function: :func:`decide`.

Every ``--interval`` seconds the planner sums up one pool of workers (a model's workers in
one role) as an :class:`Observation` — how many workers serve, how many it asked for, their
load (requests in flight, time-averaged over the interval) and the latencies the frontends
measured (p90 of TTFT and of inter-token latency) — and :func:`decide` answers how many
workers the pool should have, and why. No clock, no I/O, no randomness: the same inputs
give the same :class:`Decision`, so the rule is tested on its own with a simulated clock
(``tests/operators/planner/test_planner_policy.py``).

**What it learns.** A pool's capacity is a per-worker load: the most requests in flight per
worker at which the targets still hold. It is never configured; it is bracketed by what
the planner saw, on a settled fleet (as many workers serving as asked for, the same ones
through the whole interval):

- *good*: per-worker loads at which the targets were met (the capacity is at least that);
- *bad*: per-worker loads at which a target was missed (the capacity is below that).

A new observation overrules the old ones it contradicts (a load met removes the misses at
or below it; a miss removes the loads met at or above it), so ``max(good) < min(bad)``
always holds, and observations are forgotten after ``memory`` seconds (a workload whose
prompts grow longer has a lower capacity tomorrow).

**The rule**, in order:

1. Below ``min_workers`` or above ``max_workers``: to the bound (the only step of more
   than one worker).
2. Cool-down: within ``cooldown`` seconds of the last change, hold.
3. Up by one worker when a target is missed, or when the load per worker has reached one
   at which a miss was seen (``per_worker >= min(bad)``: the load *predicts* a miss) —
   unless a worker asked for earlier is not serving yet (it would take the load).
4. Down by one worker when nothing is in flight and no request was measured (idle: the
   planner scales to ``min_workers`` at zero load), or when the remaining workers would
   carry the load with ``headroom`` to spare: ``load / (workers - 1) <= (1 - headroom) *
   max(good)``.
5. Otherwise hold.

**Why it cannot oscillate on a steady load.** A step down leaves the per-worker load at
most ``(1 - headroom) * max(good)``, below every ``bad`` (``max(good) < min(bad)``), so no
prediction undoes it; only a real miss can, and that miss becomes a ``bad`` at that load,
which forbids the same step down for as long as it is remembered. Once up again, the load
met there is a ``good`` below that ``bad``, and no step down from there can reach it. So a
steady load sees at most one step down that turns out wrong, and never a down-up-down. One
worker per step, because each step is also a measurement: a jump to ``load / max(good)``
workers, with a capacity learned at a lower load (a lower bound), over-provisions, and
nothing at a steady load could then prove the extra workers useless.

**Which worker leaves** on a step down is :func:`drain_order`'s: the one a drain costs
least (not serving yet, else the least work in flight, then the least KV cache no other
worker holds, then the newest).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

__all__ = (
    "REASONS",
    "Decision",
    "Learned",
    "Observation",
    "Policy",
    "Reason",
    "Targets",
    "Verdict",
    "decide",
    "drain_order",
)

Reason = Literal[
    "min_workers",
    "max_workers",
    "ttft_missed",
    "itl_missed",
    "predicted",
    "idle",
    "headroom",
    "cooldown",
    "starting",
    "at_max",
    "confirming",
    "steady",
]
"""Why a :class:`Decision` is what it is: a step up (``min_workers``, ``ttft_missed``,
``itl_missed``, ``predicted``), a step down (``max_workers``, ``idle``, ``headroom``), or a
hold (``cooldown``: a change waits for the cool-down; ``starting``: a step up waits for the
workers asked for earlier; ``at_max``: a target is missed at ``max_workers``;
``confirming``: a target was missed in this round only; ``steady``)."""

#: every reason, in the order of :data:`Reason` (the metric's label values)
REASONS: tuple[Reason, ...] = get_args(Reason)

Verdict = Literal["met", "missed", "none"]
"""What the interval's latencies say of the targets (``none``: no latency was measured)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Targets:
    """The latency targets of a pool, in seconds (None: that latency is not a target).

    A prefill pool answers for the time to the first token, a decode pool for the time
    between tokens, an aggregated pool for both: the caller gives each pool the targets
    its role controls.
    """

    ttft_p90: float | None = None
    itl_p90: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p90", "itl_p90"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"the {name} target must be > 0 seconds, got {value!r}")

    def verdict(self, ttft_p90: float | None, itl_p90: float | None) -> tuple[Verdict, Reason]:
        """The verdict on these latencies, and which target was missed first (else
        ``steady``)."""
        measured = False
        for target, seen, reason in (
            (self.ttft_p90, ttft_p90, "ttft_missed"),
            (self.itl_p90, itl_p90, "itl_missed"),
        ):
            if target is None or seen is None:
                continue
            if seen > target:
                return "missed", reason  # type: ignore[return-value]
            measured = True
        return ("met" if measured else "none"), "steady"


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How a pool is planned: its targets and bounds, and how cautiously.

    Raises:
        ValueError: ``min_workers`` below 1 (scaling to zero needs a signal from the
            frontends' queues, which they do not publish), ``max_workers`` below it,
            ``headroom`` outside [0, 1), a negative ``cooldown``, or no target at all.
    """

    targets: Targets
    min_workers: int = 1
    max_workers: int = 8
    #: the share of the learned capacity a step down must leave unused
    headroom: float = 0.2
    #: seconds after a change during which no other change is made
    cooldown: float = 30.0
    #: seconds an observation counts towards the learned capacity
    memory: float = 600.0
    #: rounds in a row a target must be missed before the miss counts (one round's
    #: p90 can be noise: a slow client, a pause; a miss the load causes persists)
    confirm: int = 2

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"max_workers ({self.max_workers}) must be >= min_workers ({self.min_workers})"
            )
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom!r}")
        if self.cooldown < 0:
            raise ValueError(f"cooldown must be >= 0, got {self.cooldown!r}")
        if not self.memory > 0:
            raise ValueError(f"memory must be > 0, got {self.memory!r}")
        if self.confirm < 1:
            raise ValueError(f"confirm must be >= 1 round, got {self.confirm!r}")
        if self.targets.ttft_p90 is None and self.targets.itl_p90 is None:
            raise ValueError("give a TTFT target, an ITL target or both")


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """One pool over one interval."""

    #: the planner's clock, in seconds
    now: float
    #: workers serving (ready in discovery)
    workers: int
    #: workers the planner has asked for (those starting included, those draining not)
    target: int
    #: requests in flight on the serving workers together, averaged over the interval
    #: (None: not every serving worker has reported its load yet)
    load: float | None
    #: the p90 of the time to first token over the interval, in seconds (None: too few
    #: requests measured)
    ttft_p90: float | None = None
    #: the p90 of the inter-token latency over the interval, in seconds (None: too few)
    itl_p90: float | None = None
    #: whether the same workers served through the whole interval (a latency measured
    #: while one joined or left says nothing of either fleet: nothing is learned from it)
    settled: bool = True

    @property
    def per_worker(self) -> float | None:
        """The load per serving worker (None: unknown, or no worker serves)."""
        if self.load is None or self.workers <= 0:
            return None
        return self.load / self.workers


@dataclass(frozen=True, slots=True)
class Learned:
    """What the planner knows of one pool: the capacity's brackets and its last change.

    ``good`` holds (when, per-worker load met), latest last, loads decreasing: an older
    entry no larger than a newer one could never be the largest before it expires, so it
    is dropped. ``bad`` holds (when, per-worker load missed), loads increasing, for the
    same reason about the smallest.
    """

    good: tuple[tuple[float, float], ...] = ()
    bad: tuple[tuple[float, float], ...] = ()
    #: when the pool's size last changed (the cool-down runs from there)
    changed_at: float = -math.inf
    #: rounds in a row a target was missed (rounds without a verdict between them count
    #: neither way)
    misses: int = 0

    @property
    def capacity(self) -> float | None:
        """The largest per-worker load seen meeting the targets (None: none seen)."""
        return self.good[0][1] if self.good else None

    @property
    def limit(self) -> float | None:
        """The smallest per-worker load seen missing a target (None: none seen)."""
        return self.bad[0][1] if self.bad else None

    def remember(self, now: float, per_worker: float, verdict: Verdict) -> Learned:
        """These brackets after seeing ``per_worker`` give ``verdict`` at ``now``."""
        good, bad = self.good, self.bad
        if verdict == "met":
            good = (*((t, x) for t, x in good if x > per_worker), (now, per_worker))
            bad = tuple((t, x) for t, x in bad if x > per_worker)
        elif verdict == "missed":
            bad = (*((t, x) for t, x in bad if x < per_worker), (now, per_worker))
            good = tuple((t, x) for t, x in good if x < per_worker)
        return replace(self, good=good, bad=bad)

    def forget(self, before: float) -> Learned:
        """These brackets without what was seen before ``before``."""
        if not _any_before(self.good, before) and not _any_before(self.bad, before):
            return self
        good = tuple(entry for entry in self.good if entry[0] >= before)
        bad = tuple(entry for entry in self.bad if entry[0] >= before)
        return replace(self, good=good, bad=bad)


def _any_before(entries: Iterable[tuple[float, float]], before: float) -> bool:
    return any(when < before for when, _ in entries)


@dataclass(frozen=True, slots=True)
class Decision:
    """How many workers a pool should have after an :class:`Observation`, and why."""

    #: workers wanted from now on
    target: int
    reason: Reason
    verdict: Verdict
    #: the observation's load per serving worker (None: unknown)
    per_worker: float | None
    #: the learned capacity and limit, per worker, after this observation
    capacity: float | None = None
    limit: float | None = None
    #: the workers asked for before
    previous: int = field(default=0)

    @property
    def step(self) -> int:
        """Workers added (positive) or removed (negative) by this decision."""
        return self.target - self.previous


def decide(policy: Policy, learned: Learned, seen: Observation) -> tuple[Decision, Learned]:
    """The pool's size after ``seen``, and what the planner knows of it now (see the module
    docstring for the rule)."""
    said, missed = policy.targets.verdict(seen.ttft_p90, seen.itl_p90)
    misses = learned.misses + 1 if said == "missed" else 0 if said == "met" else learned.misses
    learned = replace(learned.forget(seen.now - policy.memory), misses=misses)
    # a miss counts once confirmed; until then it neither teaches nor adds a worker
    verdict: Verdict = "none" if said == "missed" and misses < policy.confirm else said
    per_worker = seen.per_worker
    if per_worker and seen.settled and seen.workers == seen.target:
        learned = learned.remember(seen.now, per_worker, verdict)
    target, reason = _rule(policy, learned, seen, verdict, missed)
    if reason == "steady" and verdict != said:
        reason = "confirming"
    if said == "missed" and reason in ("idle", "headroom"):  # never down on a pending miss
        target, reason = seen.target, "confirming"
    if target != seen.target:
        learned = replace(learned, changed_at=seen.now)
    decision = Decision(
        target,
        reason,
        said,
        per_worker,
        learned.capacity,
        learned.limit,
        seen.target,
    )
    return decision, learned


def _rule(
    policy: Policy, learned: Learned, seen: Observation, verdict: Verdict, missed: Reason
) -> tuple[int, Reason]:
    n = seen.target
    if n < policy.min_workers:
        return policy.min_workers, "min_workers"
    if n > policy.max_workers:
        return policy.max_workers, "max_workers"
    up = _up(learned, seen, verdict, missed)
    down = None if up is not None else _down(policy, learned, seen, verdict)
    if up is not None:
        if n >= policy.max_workers:
            return n, "at_max"
        if seen.workers < n:
            return n, "starting"
    elif down is None:
        return n, "steady"
    if seen.now - learned.changed_at < policy.cooldown:
        return n, "cooldown"
    if up is not None:
        return n + 1, up
    assert down is not None
    return n - 1, down


def _up(learned: Learned, seen: Observation, verdict: Verdict, missed: Reason) -> Reason | None:
    """Why the pool needs another worker (None: it does not)."""
    if verdict == "missed":
        return missed
    limit = learned.limit
    per_worker = seen.per_worker
    if limit is not None and per_worker is not None and per_worker >= limit:
        return "predicted"
    return None


def _down(policy: Policy, learned: Learned, seen: Observation, verdict: Verdict) -> Reason | None:
    """Why the pool can do with one worker less (None: it cannot)."""
    n = seen.target
    if n <= policy.min_workers or verdict == "missed" or seen.load is None:
        return None
    if seen.load == 0 and verdict == "none":
        return "idle"
    capacity = learned.capacity
    if capacity is None or n < 2:
        return None
    if seen.load / (n - 1) <= (1 - policy.headroom) * capacity:
        return "headroom"
    return None


def drain_order(
    own: Sequence[str],
    serving: Collection[str],
    in_flight: Callable[[str], float],
    unique_blocks: Callable[[str], int],
) -> list[str]:
    """``own`` workers (oldest first) in the order they should leave on a step down.

    Those not serving yet go first (they have nothing to lose), newest first; then the
    serving ones with the least work in flight (the fewest streams a drain may hand to
    Migration), then the fewest KV blocks no other worker holds (the prefix cache the
    fleet would lose with it), then the newest.
    """
    order = {worker_id: position for position, worker_id in enumerate(own)}

    def cost(worker_id: str) -> tuple[int, float, int, int]:
        if worker_id not in serving:
            return (0, 0.0, 0, -order[worker_id])
        return (1, in_flight(worker_id), unique_blocks(worker_id), -order[worker_id])

    return sorted(own, key=cost)
