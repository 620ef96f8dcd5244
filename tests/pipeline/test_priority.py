"""Who goes first among waiting requests (:mod:`pipeline.priority`), and a Router's waiting
requests let through in that order when a worker joins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline import Context, Router, WorkerSet
from pipeline.priority import PRIORITY_AGING, PriorityQueue, admission_key, priority_of
from pipeline.routers import Worker
from pipeline.testing import ScriptedEngine


@dataclass
class Request:
    name: str
    priority: int = 0


class Recording:
    """A policy that picks the first member and records whom it chose for."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        self.order.append(ctx.data.name)
        return workers[0]


async def test_waiting_requests_get_a_worker_by_priority_then_arrival() -> None:
    workers: WorkerSet[Any, str] = WorkerSet("decode")
    policy = Recording()
    router = Router(workers, policy, wait=30)
    requests = [Request("low-1", 5), Request("mid", 0), Request("low-2", 5), Request("high", -3)]
    async with anyio.create_task_group() as tg:
        for request in requests:  # in this order of arrival
            tg.start_soon(_drain, router, Context.new(request))
            await anyio.wait_all_tasks_blocked()
        assert workers.statistics().waiting == 4
        workers.add("w", ScriptedEngine(["x"]))
    assert policy.order == ["high", "mid", "low-1", "low-2"]


async def test_a_request_that_leaves_the_queue_is_forgotten() -> None:
    workers: WorkerSet[Any, str] = WorkerSet("decode")
    policy = Recording()
    router = Router(workers, policy, wait=30)
    left = anyio.Event()

    async def leaving(ctx: Context[Any]) -> None:
        await _drain(router, ctx)
        left.set()

    async with anyio.create_task_group() as tg:
        gone = Context.new(Request("gone", -9))
        tg.start_soon(leaving, gone)
        tg.start_soon(_drain, router, Context.new(Request("stays", 1)))
        await anyio.wait_all_tasks_blocked()
        gone.kill()
        await left.wait()
        assert workers.statistics().waiting == 1
        workers.add("w", ScriptedEngine(["x"]))
    assert policy.order == ["stays"]


async def _drain(router: Router[Any, str], ctx: Context[Any]) -> None:
    from pipeline import open_stream

    async with open_stream(router, ctx) as stream:
        async for _ in stream:
            pass


def test_aging_lets_a_long_wait_go_before_a_better_priority() -> None:
    early_low = admission_key(3, arrival=100.0)
    late_high = admission_key(0, arrival=100.0 + 3 * PRIORITY_AGING + 1)
    soon_high = admission_key(0, arrival=100.0 + 1)
    assert early_low < late_high  # it waited more than 3 levels' worth
    assert soon_high < early_low
    with pytest.raises(ValueError, match="aging"):
        admission_key(0, 0.0, aging=0)


@given(st.lists(st.tuples(st.integers(-5, 5), st.floats(0, 100)), min_size=1, max_size=30))
def test_the_queue_pops_in_key_order_first_come_first_on_ties(
    entries: list[tuple[int, float]],
) -> None:
    queue: PriorityQueue[int] = PriorityQueue()
    keys = [admission_key(priority, arrival) for priority, arrival in entries]
    for position, key in enumerate(keys):
        queue.push(key, position)
    popped = [queue.pop() for _ in range(len(queue))]
    assert popped == sorted(range(len(keys)), key=lambda i: (keys[i], i))
    assert not queue


def test_the_queue_removes_an_item_wherever_it_is() -> None:
    queue: PriorityQueue[str] = PriorityQueue()
    for key, item in [(3.0, "c"), (1.0, "a"), (2.0, "b")]:
        queue.push(key, item)
    assert queue.remove("a")
    assert not queue.remove("z")
    assert queue.peek() == "b"
    assert [queue.pop(), queue.pop()] == ["b", "c"]


def test_a_payload_without_an_integer_priority_has_priority_0() -> None:
    assert priority_of(Request("x", -2)) == -2
    assert priority_of("text") == 0
    assert priority_of(Request("x", True)) == 0  # type: ignore[arg-type]
