"""Who goes first among waiting requests: by priority, then arrival, with aging.

A request's ``priority`` is an integer, lower runs earlier (vLLM's convention), 0 by
default. Every queue that admits requests (a :class:`~pipeline.routers.WorkerSet`'s
waiting requests, an engine's slots) orders them the same way, by :func:`admission_key`::

    key = priority + arrival / aging        (smallest first; ties: first come)

That is "priority, then arrival", with **aging**: a waiting request's effective priority
improves by one level per ``aging`` seconds of waiting (:data:`PRIORITY_AGING`, 10 s), so
low priority never means never: a request that has waited ``aging * d`` seconds longer
than another goes before it even if its priority is ``d`` levels worse. Since every waiting
request ages at the same rate, the order between two of them never changes while they
wait, and the key is fixed at arrival (a heap keeps the queue; nothing is re-sorted).

The engine-agnostic part knows nothing of request types: a request's priority is the
``priority`` attribute of its data, if it has one (:func:`priority_of`).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Final, Generic, TypeVar, final

__all__ = ("PRIORITY_AGING", "PriorityQueue", "admission_key", "priority_of")

#: seconds of waiting worth one priority level
PRIORITY_AGING: Final = 10.0

T = TypeVar("T")


def priority_of(data: object) -> int:
    """The priority of a request whose payload is ``data`` (its ``priority`` attribute; 0
    when it has none)."""
    value = getattr(data, "priority", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def admission_key(priority: int, arrival: float, aging: float = PRIORITY_AGING) -> float:
    """Where a request arriving at ``arrival`` (seconds, any monotonic clock) with
    ``priority`` goes in a queue: smaller first.

    Raises:
        ValueError: ``aging`` is not above 0.
    """
    if not aging > 0:
        raise ValueError(f"aging must be > 0, got {aging}")
    return priority + arrival / aging


@final
class PriorityQueue(Generic[T]):
    """Items in :func:`admission_key` order, first come first among equal keys."""

    __slots__ = ("_count", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._count = itertools.count()

    def push(self, key: float, item: T) -> None:
        """Queue ``item`` at ``key``."""
        heapq.heappush(self._heap, (key, next(self._count), item))

    def peek(self) -> T | None:
        """The first item (None: empty)."""
        return self._heap[0][2] if self._heap else None

    def pop(self) -> T:
        """Take the first item.

        Raises:
            IndexError: the queue is empty.
        """
        return heapq.heappop(self._heap)[2]

    def remove(self, item: T) -> bool:
        """Take ``item`` out wherever it is; whether it was there."""
        for position, entry in enumerate(self._heap):
            if entry[2] is item:
                self._heap[position] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
