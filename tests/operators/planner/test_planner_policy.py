"""The planner's decision rule (``operators.planner.policy``), driven by a simulated clock.

A pool is simulated with a *knee*: a worker meets the targets while it carries at most
``knee`` requests in flight and misses them beyond, the shape of a batch that fills (the
mocker's ``--mocker-max-batch``). Optionally an adversary decides the verdict in a band
just below the knee (noise where the latency is close to its target). The properties:

- the learned brackets stay consistent (everything met is below everything missed);
- the pool stays within its bounds, moves by one worker at a time, at most once per
  cool-down;
- on a steady load it never oscillates: whatever it believed before, its steps are some
  downs, then some ups, then nothing; and once settled, three minutes bring no step;
- a load ramp low -> high -> low takes it 1 -> 3 -> 1; zero load takes it to its minimum;
- the worker to drain costs least: not serving yet, else the least in flight, then the
  least KV cache only it holds (a PrefixIndex fed as the planner feeds it), the newest.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.planner.policy import (
    REASONS,
    Decision,
    Learned,
    Observation,
    Policy,
    Targets,
    decide,
    drain_order,
)
from pipeline import PrefixIndex

TARGETS = Targets(ttft_p90=0.25)
MISSED = 1.0  # a p90 over the target
MET = 0.05  # a p90 within it


@dataclass
class Pool:
    """A simulated pool: workers appear one interval after they are asked for."""

    policy: Policy
    learned: Learned = field(default_factory=Learned)
    target: int = 1
    serving: int = 1
    events: list[tuple[float, int, int, str]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def step(self, now: float, load: float, verdict: Callable[[float], bool | None]) -> Decision:
        """One interval: ``verdict(per_worker)`` says whether the targets were met (None:
        no latency measured)."""
        per_worker = load / self.serving if self.serving else math.inf
        met = verdict(per_worker) if load > 0 else None
        ttft = None if met is None else (MET if met else MISSED)
        seen = Observation(
            now=now, workers=self.serving, target=self.target, load=load, ttft_p90=ttft
        )
        decision, self.learned = decide(self.policy, self.learned, seen)
        self.decisions.append(decision)
        if decision.target != self.target:
            self.events.append((now, self.target, decision.target, decision.reason))
        self.serving = min(self.target, decision.target) if decision.step > 0 else decision.target
        self.target = decision.target
        return decision

    def settle(self) -> None:
        """Workers asked for arrive (called between intervals)."""
        self.serving = self.target


def knee(capacity: float) -> Callable[[float], bool]:
    return lambda per_worker: per_worker <= capacity


def run(pool: Pool, loads: list[float], interval: float, verdict: Callable[[float], bool | None]):
    now = 0.0
    for load in loads:
        now += interval
        pool.step(now, load, verdict)
        pool.settle()
    return now


def test_a_ramp_low_high_low_goes_1_3_1() -> None:
    policy = Policy(targets=TARGETS, min_workers=1, max_workers=6, cooldown=10, headroom=0.2)
    pool = Pool(policy)
    interval = 2.0
    loads = [2.0] * 30 + [12.0] * 60 + [2.0] * 60
    run(pool, loads, interval, knee(4))
    sizes = [pool.events[0][1]] + [to for _, _, to, _ in pool.events]
    assert sizes == [1, 2, 3, 2, 1]
    reasons = [reason for *_, reason in pool.events]
    assert reasons == ["ttft_missed", "ttft_missed", "headroom", "headroom"]
    times = [when for when, *_ in pool.events]
    assert all(b - a >= policy.cooldown for a, b in itertools.pairwise(times))


def test_zero_load_scales_down_to_the_minimum_one_cooldown_at_a_time() -> None:
    policy = Policy(targets=TARGETS, min_workers=2, max_workers=8, cooldown=30)
    pool = Pool(policy, target=7, serving=7)
    run(pool, [0.0] * 200, 5.0, knee(4))
    assert pool.target == 2
    assert [reason for *_, reason in pool.events] == ["idle"] * 5
    assert [when for when, *_ in pool.events] == [5.0, 35.0, 65.0, 95.0, 125.0]


def test_below_the_minimum_it_starts_workers_at_once() -> None:
    policy = Policy(targets=TARGETS, min_workers=3, max_workers=8)
    decision, _ = decide(
        policy, Learned(changed_at=0.0), Observation(now=1.0, workers=0, target=0, load=None)
    )
    assert (decision.target, decision.reason) == (3, "min_workers")


def test_a_miss_waits_for_the_workers_already_asked_for() -> None:
    policy = Policy(targets=TARGETS, cooldown=0, confirm=1)
    seen = Observation(now=100.0, workers=1, target=2, load=10.0, ttft_p90=MISSED)
    decision, _ = decide(policy, Learned(), seen)
    assert (decision.target, decision.reason) == (2, "starting")


def test_a_miss_at_the_maximum_holds_and_says_so() -> None:
    policy = Policy(targets=TARGETS, max_workers=2, confirm=1)
    seen = Observation(now=100.0, workers=2, target=2, load=10.0, ttft_p90=MISSED)
    decision, _ = decide(policy, Learned(), seen)
    assert (decision.target, decision.reason, decision.verdict) == (2, "at_max", "missed")


def test_a_load_where_misses_were_seen_predicts_one() -> None:
    policy = Policy(targets=TARGETS, cooldown=0)
    learned = Learned().remember(0.0, 5.0, "missed")
    seen = Observation(now=10.0, workers=2, target=2, load=10.0)  # no latency measured
    decision, _ = decide(policy, learned, seen)
    assert (decision.target, decision.reason) == (3, "predicted")


def test_unknown_load_never_scales_down() -> None:
    policy = Policy(targets=TARGETS, cooldown=0)
    learned = Learned().remember(0.0, 5.0, "met")
    for ttft in (None, MET):
        seen = Observation(now=10.0, workers=4, target=4, load=None, ttft_p90=ttft)
        decision, _ = decide(policy, learned, seen)
        assert decision.target == 4


def test_itl_is_judged_like_ttft() -> None:
    policy = Policy(targets=Targets(itl_p90=0.05), cooldown=0, confirm=1)
    seen = Observation(now=10.0, workers=1, target=1, load=3.0, ttft_p90=9.0, itl_p90=0.08)
    decision, _ = decide(policy, Learned(), seen)
    assert (decision.target, decision.reason) == (2, "itl_missed")
    seen = Observation(now=10.0, workers=1, target=1, load=3.0, ttft_p90=9.0, itl_p90=0.01)
    decision, _ = decide(policy, Learned(), seen)
    assert decision.verdict == "met"  # the TTFT is no target of this pool


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_workers": 0}, "min_workers must be >= 1"),
        ({"min_workers": 3, "max_workers": 2}, "max_workers (2) must be >= min_workers (3)"),
        ({"headroom": 1.0}, "headroom must be in [0, 1)"),
        ({"cooldown": -1.0}, "cooldown must be >= 0"),
        ({"confirm": 0}, "confirm must be >= 1 round"),
        ({"targets": Targets()}, "give a TTFT target, an ITL target or both"),
    ],
)
def test_bad_policies_are_refused_by_name(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Policy(**{"targets": TARGETS, **options})  # type: ignore[arg-type]


def test_a_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttft_p90 target must be > 0"):
        Targets(ttft_p90=0.0)


def test_every_reason_is_listed_once() -> None:
    assert len(set(REASONS)) == len(REASONS) == 12


def test_a_miss_counts_once_confirmed_by_the_next_round() -> None:
    policy = Policy(targets=TARGETS, cooldown=0, confirm=2)
    learned = Learned().remember(0.0, 1.0, "met")

    def round_(now: float, ttft: float | None, learned: Learned) -> tuple[Decision, Learned]:
        seen = Observation(now=now, workers=2, target=2, load=6.0, ttft_p90=ttft)
        return decide(policy, learned, seen)

    decision, learned = round_(1.0, MISSED, learned)
    assert (decision.target, decision.reason, decision.verdict) == (2, "confirming", "missed")
    assert learned.limit is None  # not learned either
    decision, learned = round_(2.0, MET, learned)  # a met round starts over
    assert (decision.target, decision.reason, learned.misses) == (2, "steady", 0)
    decision, learned = round_(3.0, MISSED, learned)
    decision, learned = round_(4.0, None, learned)  # a round without a verdict counts neither way
    assert learned.misses == 1
    decision, learned = round_(5.0, MISSED, learned)
    assert (decision.target, decision.reason) == (3, "ttft_missed")
    assert learned.limit == 3.0


def test_a_pending_miss_stops_a_step_down() -> None:
    policy = Policy(targets=TARGETS, cooldown=0, confirm=2)
    learned = Learned().remember(0.0, 10.0, "met")
    seen = Observation(now=1.0, workers=3, target=3, load=3.0, ttft_p90=MISSED)
    decision, _ = decide(policy, learned, seen)
    assert (decision.target, decision.reason) == (3, "confirming")


# -- properties -------------------------------------------------------------------------------

stale_entries = st.lists(
    st.tuples(st.floats(-100.0, 0.0), st.floats(0.1, 40.0), st.booleans()), max_size=6
)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    max_workers = draw(st.integers(1, 10))
    min_workers = draw(st.integers(1, max_workers))
    headroom = draw(st.floats(0.05, 0.5))
    return {
        "policy": Policy(
            targets=TARGETS,
            min_workers=min_workers,
            max_workers=max_workers,
            headroom=headroom,
            cooldown=draw(st.sampled_from([0.0, 5.0, 30.0])),
            memory=draw(st.sampled_from([60.0, 600.0])),
            confirm=draw(st.sampled_from([1, 2, 3])),
        ),
        "start": draw(st.integers(min_workers, max_workers)),
        "capacity": draw(st.floats(0.5, 20.0)),
        "load": draw(st.floats(0.0, 100.0)),
        "interval": draw(st.sampled_from([1.0, 5.0, 10.0])),
        "stale": draw(stale_entries),
        # the adversary's band below the knee, narrower than the headroom
        "band": draw(st.floats(0.0, 0.99)) * headroom,
        "noise": draw(st.lists(st.booleans(), min_size=1, max_size=50)),
    }


def _learned(stale: list[tuple[float, float, bool]]) -> Learned:
    learned = Learned()
    for when, per_worker, met in sorted(stale):
        learned = learned.remember(when, per_worker, "met" if met else "missed")
    return learned


def _adversary(capacity: float, band: float, noise: list[bool]) -> Callable[[float], bool]:
    turns = iter(noise * 1000)

    def verdict(per_worker: float) -> bool:
        if per_worker > capacity:
            return False
        if per_worker > capacity * (1 - band):
            return next(turns)
        return True

    return verdict


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_a_steady_load_never_oscillates(scenario: dict[str, object]) -> None:
    policy = scenario["policy"]
    assert isinstance(policy, Policy)
    start, interval = scenario["start"], scenario["interval"]
    assert isinstance(start, int)
    assert isinstance(interval, float)
    pool = Pool(policy, learned=_learned(scenario["stale"]), target=start, serving=start)  # type: ignore[arg-type]
    pool.learned = replace(pool.learned, changed_at=-math.inf)
    verdict = _adversary(scenario["capacity"], scenario["band"], scenario["noise"])  # type: ignore[arg-type]
    settling = 2 * policy.max_workers * (policy.cooldown + (policy.confirm + 1) * interval)
    steps = int((settling + policy.memory + 180.0) / interval) + 1
    end = run(pool, [float(scenario["load"])] * steps, interval, verdict)  # type: ignore[arg-type]

    signs = "".join("+" if to > before else "-" for _, before, to, _ in pool.events)
    assert re.fullmatch(r"-*\+*", signs), f"oscillated: {pool.events}"
    assert all(policy.min_workers <= d.target <= policy.max_workers for d in pool.decisions)
    assert all(abs(d.step) <= 1 for d in pool.decisions)
    times = [when for when, *_ in pool.events]
    assert all(b - a >= policy.cooldown for a, b in itertools.pairwise(times))
    assert not [e for e in pool.events if e[0] > end - 180.0], "a step in the last 3 minutes"


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_a_steady_load_ends_within_its_targets_unless_at_the_maximum(
    scenario: dict[str, object],
) -> None:
    policy = scenario["policy"]
    assert isinstance(policy, Policy)
    capacity, load, interval = scenario["capacity"], scenario["load"], scenario["interval"]
    assert isinstance(capacity, float)
    assert isinstance(load, float)
    assert isinstance(interval, float)
    start = scenario["start"]
    assert isinstance(start, int)
    pool = Pool(policy, learned=_learned(scenario["stale"]), target=start, serving=start)  # type: ignore[arg-type]
    settling = 2 * policy.max_workers * (policy.cooldown + (policy.confirm + 1) * interval)
    steps = int(settling / interval) + policy.confirm + 2
    run(pool, [load] * steps, interval, knee(capacity))
    assert pool.target == policy.max_workers or load / pool.target <= capacity
    if load == 0:
        assert pool.target == policy.min_workers


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 1000.0), st.floats(0.0, 50.0), st.sampled_from(["met", "missed", "none"])
        ),
        max_size=40,
    ),
    st.floats(1.0, 1000.0),
)
def test_what_is_learned_stays_consistent(
    seen: list[tuple[float, float, str]], memory: float
) -> None:
    learned = Learned()
    for now, per_worker, verdict in sorted(seen):
        learned = learned.forget(now - memory).remember(now, per_worker, verdict)  # type: ignore[arg-type]
        if learned.capacity is not None and learned.limit is not None:
            assert learned.capacity < learned.limit
        goods = [x for _, x in learned.good]
        bads = [x for _, x in learned.bad]
        assert goods == sorted(goods, reverse=True)
        assert len(set(goods)) == len(goods)
        assert bads == sorted(bads)
        assert len(set(bads)) == len(bads)
        if verdict == "met":  # the newest word: kept, and nothing missed at or below it
            assert goods[-1] == per_worker
            assert all(x > per_worker for x in bads)
        elif verdict == "missed":
            assert bads[-1] == per_worker
            assert all(x < per_worker for x in goods)


def test_nothing_is_learned_while_the_fleet_changes() -> None:
    policy = Policy(targets=TARGETS, cooldown=0, confirm=1)
    for settled, workers, target in ((False, 2, 2), (True, 1, 2)):
        seen = Observation(
            now=10.0, workers=workers, target=target, load=8.0, ttft_p90=MISSED, settled=settled
        )
        _, learned = decide(policy, Learned(), seen)
        assert learned.limit is None
    seen = Observation(now=10.0, workers=2, target=2, load=8.0, ttft_p90=MISSED)
    _, learned = decide(policy, Learned(), seen)
    assert learned.limit == 4.0


def test_the_worker_drained_holds_the_least_unique_kv_among_the_least_loaded() -> None:
    index = PrefixIndex()
    index.stored("w-1", [1, 2, 3, 4])  # four blocks, each held elsewhere too
    index.stored("w-2", [1, 2, 5])  # one only it holds
    index.stored("w-3", [3, 4, 6, 7, 8])  # three only it holds
    assert [index.unique_blocks(w) for w in ("w-1", "w-2", "w-3")] == [0, 1, 3]
    index.stored("w-1", [9, 10])
    assert index.unique_blocks("w-1") == 2
    loads = {"w-1": 2.0, "w-2": 2.0, "w-3": 2.0}
    own = ["w-1", "w-2", "w-3"]  # (oldest first)
    assert drain_order(own, set(own), loads.__getitem__, index.unique_blocks) == [
        "w-2",
        "w-1",
        "w-3",
    ]
    # Work in flight comes first: a drain's streams move; its cache only goes cold.
    loads["w-3"] = 1.0
    assert drain_order(own, set(own), loads.__getitem__, index.unique_blocks)[0] == "w-3"
    # One not serving yet has nothing to lose; on a tie, the newest goes.
    assert drain_order(own, {"w-1", "w-3"}, loads.__getitem__, index.unique_blocks)[0] == "w-2"
    assert drain_order(own, set(own), lambda _: 0.0, lambda _: 0) == ["w-3", "w-2", "w-1"]


@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=8)
)
def test_the_drain_order_is_by_serving_then_in_flight_then_unique_kv_then_age(
    workers: list[tuple[bool, int, int]],
) -> None:
    own = [f"w-{i}" for i in range(len(workers))]
    serving = {w for w, (serves, _, _) in zip(own, workers, strict=True) if serves}
    facts = dict(zip(own, workers, strict=True))
    order = drain_order(own, serving, lambda w: float(facts[w][1]), lambda w: facts[w][2])
    assert sorted(order) == sorted(own)
    keys = [
        (w in serving, facts[w][1] if w in serving else 0, facts[w][2] if w in serving else 0)
        for w in order
    ]
    assert keys == sorted(keys)
    for a, b in itertools.pairwise(order):  # equal costs: the newer one first
        if keys[order.index(a)] == keys[order.index(b)]:
            assert own.index(a) > own.index(b)
