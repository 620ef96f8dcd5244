"""First come, first served admission to the llama engine's slots (the request tasks' side).

Apart from :mod:`.engine` only to keep that module short; the engine holds one.
"""

from __future__ import annotations

from typing import final

import anyio

__all__ = ("Slots",)


@final
class Slots:
    """First come, first served access to the engine's slots; a request takes all the
    slots it needs at once (one per choice, up to ``parallel``).

    A FIFO lock is the turnstile, so a request waiting for its second slot keeps everyone
    behind it waiting rather than letting them take the slot it needs. The semaphore, unlike
    a lock, may be released from any task: an abandoned stream's finalizer.
    """

    def __init__(self, count: int) -> None:
        self._free = anyio.Semaphore(count)
        self._turnstile = anyio.Lock()
        #: slots asked for by requests still in the queue
        self.waiting = 0

    async def acquire(self, width: int) -> None:
        taken = 0
        self.waiting += width
        try:
            async with self._turnstile:
                while taken < width:
                    await self._free.acquire()
                    taken += 1
        except BaseException:  # cancelled while waiting: leave the queue, give back
            self.release(taken)
            raise
        finally:
            self.waiting -= width

    def release(self, width: int) -> None:
        for _ in range(width):
            self._free.release()
