"""The client's side of one in-flight request: its inbox buffer and its idle bookkeeping.

Apart from :class:`~.client.RemoteEngine` because it is the per-message hot path
(a deque and a bare future, no anyio primitive per message) and the only code that runs in
nats-py's callback task; the engine only creates, ticks and reads these.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, final

from nats.aio.msg import Msg

from . import wire

if TYPE_CHECKING:
    from pipeline.context import Context

__all__ = ("IDLE", "STOPPED", "ClientStream", "Signal")


@final
class Signal:
    """Something other than a frame woke a client stream: the idle timer, a stop, a loss."""

    __slots__ = ("reason",)

    def __init__(self, reason: str = "") -> None:
        self.reason = reason


IDLE = Signal("idle")
STOPPED = Signal("stopped")


@final
class ClientStream:
    """One in-flight request on the client: its inbox buffer and its idle bookkeeping.

    The inbox subscription's callback appends to a deque and wakes the stream's task
    through a bare future when it waits: no memory stream, event or checkpoint per
    message, which costs several µs each (the task is woken by the future; anyio's
    cancellation reaches it there like at any other await).
    """

    __slots__ = (
        "_closed",
        "_items",
        "_waiter",
        "ctx",
        "frames",
        "idle_pending",
        "quiet",
        "seen",
        "stop_pending",
    )

    def __init__(self, ctx: Context[Any]) -> None:
        self.ctx = ctx
        self._items: deque[Msg | Signal] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self.frames = 0  # messages received, for the idle timer
        self.seen = 0  # ``frames`` at the previous tick
        self.quiet = 0.0  # seconds without a message, in ticks
        self.idle_pending = False
        self.stop_pending = False

    async def on_msg(self, msg: Msg) -> None:
        """The inbox subscription's callback (runs in nats-py's task): hand the message over.

        An out-of-band heartbeat only counts as a sign of life: it is never queued.
        """
        self.frames += 1
        headers = msg.headers
        if headers is not None and wire.HEARTBEAT in headers:
            return
        self.signal(msg)

    def signal(self, item: Msg | Signal) -> None:
        if self._closed:
            return  # the stream already ended
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def pending(self) -> bool:
        """Whether messages are waiting to be read."""
        return bool(self._items)

    @property
    def buffered(self) -> int:
        """Messages waiting to be read."""
        return len(self._items)

    async def next(self) -> Msg | Signal:
        items = self._items
        while not items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return items.popleft()

    def tick(self, interval: float, idle: float) -> None:
        """Called every ``interval`` seconds by the engine's timer."""
        if self.frames != self.seen:
            self.seen = self.frames
            self.quiet = 0.0
        else:
            self.quiet += interval
            if self.quiet >= idle and not self.idle_pending:
                self.idle_pending = True
                self.quiet = 0.0
                self.signal(IDLE)
        if self.ctx.is_stopped and not self.stop_pending:
            self.stop_pending = True
            self.signal(STOPPED)

    def close(self) -> None:
        self._closed = True
        self._items.clear()
