"""The fair queue (``operators.edges.http.fair_queue``): within a priority, keys are admitted
in proportion to their shares whoever floods; between priorities, the lower goes first
until aging lets the other through."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operators.edges.http.fair_queue import FairQueue
from pipeline.priority import PRIORITY_AGING


def drain(queue: FairQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


@given(
    shares=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    costs=st.tuples(st.integers(1, 500), st.integers(1, 500)),
    backlog=st.tuples(st.integers(1, 40), st.integers(1, 40)),
)
def test_two_waiting_keys_are_admitted_in_proportion_to_their_shares(
    shares: tuple[int, int], costs: tuple[int, int], backlog: tuple[int, int]
) -> None:
    """SFQ's bound: in any prefix of the admissions while both keys still wait, what each
    got divided by its share differs by at most one request's cost over its share."""
    queue: FairQueue[str] = FairQueue()
    for index, key in enumerate("ab"):
        for _ in range(backlog[index]):
            start = queue.tag(0, key, shares[index], costs[index])
            queue.push(key, priority=0, start=start, arrival=0.0)
    served = {"a": 0.0, "b": 0.0}
    left = {"a": backlog[0], "b": backlog[1]}
    bound = costs[0] / shares[0] + costs[1] / shares[1]
    while left["a"] and left["b"]:
        key = queue.pop()
        served[key] += costs["ab".index(key)]
        left[key] -= 1
        if left["a"] and left["b"]:
            assert abs(served["a"] / shares[0] - served["b"] / shares[1]) <= bound + 1e-9


def test_a_key_arriving_behind_a_flood_goes_before_most_of_it() -> None:
    """Key A floods 64 requests (8 taken at once, the rest wait); key B's 4 come after
    and are admitted within the next 8, every other one."""
    queue: FairQueue[str] = FairQueue()
    for number in range(64):
        start = queue.tag(0, "a", 1.0, 100)
        if number < 8:
            queue.started(0, start)  # admitted without waiting
        else:
            queue.push(f"a{number}", priority=0, start=start, arrival=float(number))
    for number in range(4):
        start = queue.tag(0, "b", 1.0, 100)
        queue.push(f"b{number}", priority=0, start=start, arrival=100.0)
    order = drain(queue)
    positions = [order.index(f"b{number}") for number in range(4)]
    assert positions == sorted(positions)
    assert positions[-1] < 8
    assert order[:8] == ["b0", "a8", "b1", "a9", "b2", "a10", "b3", "a11"]


def test_shares_weigh_the_keys() -> None:
    queue: FairQueue[str] = FairQueue()
    for _ in range(30):
        for key, share in (("heavy", 3.0), ("light", 1.0)):
            queue.push(key, priority=0, start=queue.tag(0, key, share, 10), arrival=0.0)
    first = drain(queue)[:20]
    assert first.count("heavy") == 15
    assert first.count("light") == 5


def test_priorities_come_first_and_a_lower_one_ages_into_its_turn() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("low", priority=2, start=queue.tag(2, "a", 1, 10), arrival=0.0)
    queue.push("high", priority=0, start=queue.tag(0, "b", 1, 10), arrival=5.0)
    assert queue.pop() == "high"  # 0 + 5/10 < 2 + 0/10
    queue.push("low2", priority=2, start=queue.tag(2, "a", 1, 10), arrival=1.0)
    # one level per PRIORITY_AGING seconds: "low" has waited 2 levels' worth by then
    queue.push("late", priority=0, start=queue.tag(0, "b", 1, 10), arrival=2 * PRIORITY_AGING + 1)
    assert queue.pop() == "low"
    assert drain(queue) == ["low2", "late"]


def test_removed_requests_leave_no_trace() -> None:
    queue: FairQueue[str] = FairQueue()
    entries = [
        queue.push(name, priority=0, start=queue.tag(0, name, 1, 1), arrival=0.0)
        for name in ("x", "y", "z")
    ]
    assert queue.remove(entries[0])
    assert not queue.remove(entries[0])
    assert len(queue) == 2
    last = queue.last()
    assert last is not None
    assert last.item == "z"
    assert drain(queue) == ["y", "z"]
    assert queue.peek() is None
    assert queue.last() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_the_last_request_is_of_the_worst_priority() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("urgent", priority=-1, start=queue.tag(-1, "a", 1, 99), arrival=0.0)
    queue.push("batch", priority=5, start=queue.tag(5, "b", 1, 1), arrival=0.0)
    last = queue.last()
    assert last is not None
    assert last.item == "batch"


def test_aging_must_be_positive() -> None:
    with pytest.raises(ValueError, match="aging"):
        FairQueue(aging=0)
