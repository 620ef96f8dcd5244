"""The llama engine's admission to its slots (``_slots.Slots``), without a model: priority
then arrival, all of a request's slots at once, and a waiter that leaves."""

from __future__ import annotations

import anyio

from operators.engines.llama._slots import Slots


async def test_waiters_get_slots_by_priority_then_arrival_and_all_at_once() -> None:
    slots = Slots(2)
    await slots.acquire(2)  # both taken
    order: list[str] = []

    async def waiter(name: str, width: int, priority: int) -> None:
        await slots.acquire(width, priority)
        order.append(name)

    async with anyio.create_task_group() as tg:
        for name, width, priority in (("a", 1, 0), ("wide", 2, -1), ("b", 1, 0), ("c", 1, 5)):
            tg.start_soon(waiter, name, width, priority)
            await anyio.wait_all_tasks_blocked()
        assert slots.waiting == 5
        slots.release(1)  # "wide" goes first and needs two: nobody overtakes it
        await anyio.wait_all_tasks_blocked()
        assert order == []
        slots.release(1)
        await anyio.wait_all_tasks_blocked()
        assert order == ["wide"]
        slots.release(2)
        await anyio.wait_all_tasks_blocked()
        assert order == ["wide", "a", "b"]
        slots.release(1)
    assert order == ["wide", "a", "b", "c"]
    assert slots.waiting == 0


async def test_a_waiter_cancelled_in_the_queue_leaves_it_and_lets_the_next_in() -> None:
    slots = Slots(2)
    await slots.acquire(2)
    got: list[str] = []
    leaves = anyio.CancelScope()

    async def first() -> None:
        with leaves:
            await slots.acquire(2)
            got.append("first")

    async def second() -> None:
        await slots.acquire(1)
        got.append("second")

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        slots.release(1)  # one free: the first in line needs two, so the second waits
        await anyio.wait_all_tasks_blocked()
        assert got == []
        leaves.cancel()  # the first leaves the queue: the second takes the free slot
    assert got == ["second"]
    assert slots.waiting == 0
