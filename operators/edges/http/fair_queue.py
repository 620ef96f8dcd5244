"""Who goes first among requests waiting for a slot: priorities first (with aging), then, in
one priority, each key in proportion to its share: :class:`FairQueue`.

One key flooding the queue must not starve another of the same priority, so within a
priority level the order is start-time fair queueing (Goyal, Vin and Cheng's SFQ) by
tokens: each arrival gets a *start tag* when it arrives, and the level admits the
smallest tag first::

    start  = max(virtual, finish[key])       virtual: the start tag of the level's last
    finish[key] = start + cost / share                admission (0 at first)

A key that sends 64 requests has tags spread over 64 of its requests' costs; a key that
then sends one gets the level's current virtual time, so it goes before most of the
flood. Over any stretch where two keys both wait, what each is admitted, divided by its
share, differs by at most one request's cost (over its share): the queue is fair to a
request, whatever the keys' rates. Tags are fixed at arrival, as :mod:`pipeline.priority`
wants of an admission key: nothing is re-sorted while requests wait.

Between levels it is :func:`pipeline.priority.admission_key`'s rule, applied to each
level's oldest waiting request: the level whose ``priority + arrival / aging`` is smallest
goes next, so a lower priority still ages into its turn (one level per
:data:`~pipeline.priority.PRIORITY_AGING` seconds of waiting), and is never starved.

Pure bookkeeping: no clock, no tasks (:mod:`.admission` waits on it).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar, final

from pipeline.priority import PRIORITY_AGING

__all__ = ("FairQueue", "Waiting")

T = TypeVar("T")

#: levels kept without a waiting request (their keys' tags) before the empty ones go
_MAX_IDLE_LEVELS: Final = 64


@final
@dataclass(eq=False, slots=True)
class Waiting(Generic[T]):
    """One waiting request: its place in the queue."""

    item: T
    priority: int
    start: float
    arrival: float
    order: int
    #: still in the queue
    queued: bool = True


@dataclass(slots=True)
class _Level(Generic[T]):
    """The requests of one priority."""

    #: the start tag of the last request admitted from this level
    virtual: float = 0.0
    #: each key's finish tag
    finish: dict[str, float] = field(default_factory=dict)
    #: (start, order, entry), smallest first
    heap: list[tuple[float, int, Waiting[T]]] = field(default_factory=list)
    #: entries in arrival order (popped or removed ones skipped lazily)
    arrivals: deque[Waiting[T]] = field(default_factory=deque)
    count: int = 0

    def oldest(self) -> Waiting[T]:
        arrivals = self.arrivals
        while not arrivals[0].queued:
            arrivals.popleft()
        return arrivals[0]


@final
class FairQueue(Generic[T]):
    """Waiting requests: by priority with aging between levels, fair by key within one.

    Every request is tagged on arrival (:meth:`tag`), whether it waits or not; one that
    waits is :meth:`push`-ed with its tag, one admitted at once is :meth:`started`.
    """

    __slots__ = ("_aging", "_count", "_levels", "_order")

    def __init__(self, aging: float = PRIORITY_AGING) -> None:
        if not aging > 0:
            raise ValueError(f"aging must be > 0, got {aging}")
        self._aging = aging
        self._levels: dict[int, _Level[T]] = {}
        self._order = itertools.count()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def tag(self, priority: int, key: str, share: float, cost: float) -> float:
        """The start tag of a request of ``key`` (weight ``share`` > 0) arriving now with
        ``cost`` (its tokens, or an estimate)."""
        level = self._levels.get(priority)
        if level is None:
            if len(self._levels) >= _MAX_IDLE_LEVELS:
                self._forget_idle()
            level = self._levels[priority] = _Level()
        start = max(level.virtual, level.finish.get(key, 0.0))
        level.finish[key] = start + max(cost, 0.0) / share
        return start

    def started(self, priority: int, start: float) -> None:
        """A request tagged ``start`` was admitted without waiting."""
        level = self._levels.get(priority)
        if level is not None and start > level.virtual:
            level.virtual = start

    def push(self, item: T, *, priority: int, start: float, arrival: float) -> Waiting[T]:
        """Queue ``item`` (tagged ``start`` by :meth:`tag`, arrived at ``arrival``)."""
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level()
        entry = Waiting(item, priority, start, arrival, next(self._order))
        heapq.heappush(level.heap, (start, entry.order, entry))
        level.arrivals.append(entry)
        level.count += 1
        self._count += 1
        return entry

    def peek(self) -> Waiting[T] | None:
        """The request that goes next (None: none waits)."""
        level = self._next_level()
        return None if level is None else self._head(level)

    def pop(self) -> T:
        """Take the request that goes next.

        Raises:
            IndexError: none waits.
        """
        level = self._next_level()
        if level is None:
            raise IndexError("pop from an empty FairQueue")
        entry = self._head(level)
        heapq.heappop(level.heap)
        if entry.start > level.virtual:
            level.virtual = entry.start
        self._leave(level, entry)
        return entry.item

    def remove(self, entry: Waiting[T]) -> bool:
        """Take ``entry`` out (its client left, its deadline passed); whether it was in."""
        if not entry.queued:
            return False
        level = self._levels[entry.priority]
        self._leave(level, entry)  # (its heap item is dropped when it surfaces)
        return True

    def last(self) -> Waiting[T] | None:
        """The request that would go last, roughly: the largest tag of the worst
        priority waiting (None: none waits). A full queue gives up this one for a newcomer
        that would go before it."""
        worst = max((p for p, level in self._levels.items() if level.count), default=None)
        if worst is None:
            return None
        entries = [entry for _, _, entry in self._levels[worst].heap if entry.queued]
        return max(entries, key=lambda entry: (entry.start, entry.order))

    def _next_level(self) -> _Level[T] | None:
        best: _Level[T] | None = None
        best_key = 0.0
        for priority, level in self._levels.items():
            if not level.count:
                continue
            key = priority + level.oldest().arrival / self._aging
            if best is None or key < best_key:
                best, best_key = level, key
        return best

    @staticmethod
    def _head(level: _Level[T]) -> Waiting[T]:
        heap = level.heap
        while not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][2]

    def _leave(self, level: _Level[T], entry: Waiting[T]) -> None:
        entry.queued = False
        level.count -= 1
        self._count -= 1
        if not level.count:
            level.heap.clear()
            level.arrivals.clear()
            virtual = level.virtual
            level.finish = {k: f for k, f in level.finish.items() if f > virtual}

    def _forget_idle(self) -> None:
        """Drop the levels no request waits in (their keys' tags start afresh)."""
        self._levels = {p: level for p, level in self._levels.items() if level.count}
