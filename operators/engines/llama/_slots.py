"""Admission to the llama engine's slots by priority, then arrival (the request tasks' side).

Apart from :mod:`.engine` only to keep that module short; the engine holds one.
"""

from __future__ import annotations

from typing import final

import anyio
import anyio.lowlevel

from pipeline.priority import PriorityQueue, admission_key

__all__ = ("Slots",)


@final
class _Waiter:
    __slots__ = ("event", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self.event = anyio.Event()


@final
class Slots:
    """Access to the engine's slots in :mod:`pipeline.priority` order (priority, then
    arrival, a waiting request's priority improving with its wait); a request takes all
    the slots it needs at once (one per choice, up to ``parallel``).

    The first waiting request is served first even when a later one would fit in the slots
    free now: a request waiting for its second slot keeps everyone behind it waiting rather
    than letting them take the slot it needs. No preemption: a running request keeps its
    slots. Slots may be released from any task (an abandoned stream's finalizer).
    """

    def __init__(self, count: int) -> None:
        self._free = count
        self._queue: PriorityQueue[_Waiter] = PriorityQueue()
        #: slots asked for by requests still in the queue
        self.waiting = 0

    async def acquire(self, width: int, priority: int = 0) -> None:
        """Take ``width`` slots, waiting behind the requests that go first."""
        if not self._queue and self._free >= width:
            self._free -= width
            try:
                await anyio.lowlevel.checkpoint()  # a cancellation point, as when waiting
            except BaseException:
                self.release(width)
                raise
            return
        waiter = _Waiter(width)
        self._queue.push(admission_key(priority, anyio.current_time()), waiter)
        self.waiting += width
        try:
            await waiter.event.wait()
        except BaseException:  # cancelled while waiting: leave the queue, or give back
            if not self._queue.remove(waiter):
                self.release(width)
            else:
                self._grant()  # those behind it may fit now
            raise
        finally:
            self.waiting -= width

    def release(self, width: int) -> None:
        self._free += width
        self._grant()

    def _grant(self) -> None:
        queue = self._queue
        while queue:
            first = queue.peek()
            assert first is not None
            if first.width > self._free:
                return
            queue.pop()
            self._free -= first.width
            first.event.set()
