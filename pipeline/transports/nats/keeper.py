"""A worker's streams beside their outputs: control, vanished clients, heartbeats, outages.

:class:`~.worker.NatsWorker` owns the subscriptions and the lifecycle and runs each request
(:mod:`.serving`, :mod:`.outbox`); the :class:`Keeper` holds the streams being served and
handles what reaches them from elsewhere: the clients' control messages (stop, kill,
credit, ping), the "no responders" that says a client vanished, and the heartbeat loop,
which also parks every stream through a bus outage and cuts off those whose clients do
not come back for them.

Frames lost without an outage this worker saw (its connection lost and back between two
rounds of the loop, or the client's) are sent again too: a client's PING says which frame
it expects next, and a flow-controlled stream whose client is behind what was sent is
parked and resumed from there, as after an outage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, final

import anyio

from . import wire
from .bus import bus_of
from .connection import quietly
from .wire import control_codec

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from .outbox import Outbox, Served
    from .wire import NatsTimeouts

__all__ = ("Keeper",)

logger = logging.getLogger("pipeline.transports.nats.worker")


@final
class Keeper:
    """The streams a worker serves, and what reaches them besides their outputs."""

    __slots__ = ("_busy", "_on_drain", "_outbox", "_timeouts", "by_reply", "nc", "served", "tg")

    def __init__(
        self, outbox: Outbox, timeouts: NatsTimeouts, on_drain: Callable[[], None]
    ) -> None:
        self._outbox = outbox
        self._timeouts = timeouts
        #: what a DRAIN control message does (a planner scaling this worker down)
        self._on_drain = on_drain
        #: the streams being served, by their client's reply inbox (their identity)
        self.served: dict[str, Served] = {}
        #: the same, by where NATS reports "no responders" on that inbox
        self.by_reply: dict[str, Served] = {}
        #: the worker's connection and task group, while it serves
        self.nc: Client | None = None
        self.tg: anyio.abc.TaskGroup | None = None
        #: set when a request arrives (the heartbeat loop waits for one while idle)
        self._busy: anyio.Event | None = None

    def arrived(self) -> None:
        """A request arrived (wakes the heartbeat loop of an idle worker)."""
        if self._busy is not None:
            self._busy.set()

    async def heartbeats(self) -> None:
        """Heartbeats for quiet streams; and through a bus outage, park every stream (see
        :mod:`.outbox`) and cut off those whose clients do not come back for them.

        Only while there are streams: an idle worker's loop sleeps until a request
        arrives (a round of an idle worker had nothing to do, 4 times a second)."""
        assert self.nc is not None
        bus = bus_of(self.nc)
        reconnections = bus.reconnections
        while True:
            if not self.served:
                self._busy = anyio.Event()
                await self._busy.wait()
                reconnections = bus.reconnections  # (what happened while idle lost nothing)
            await anyio.sleep(self._timeouts.heartbeat)
            # Down, or back since the last round: what was sent meanwhile may be lost (a
            # connection lost and back between two rounds was never seen down), so every
            # stream waits for its client's ping to say where to resume.
            down = not bus.connected or bus.reconnections != reconnections
            reconnections = bus.reconnections
            now = time.monotonic()
            for served in list(self.served.values()):
                if down:
                    served.park()
                elif served.parked is not None:
                    if self._abandoned(served, now):
                        logger.warning(
                            "worker %s: the client of a stream held through a NATS outage "
                            "did not come back for it",
                            self._outbox.worker_id,
                        )
                        self._outbox.client_gone(served)
                elif served.ctx is not None and served.seq == served.beat and not served.gone:
                    await self._outbox.heartbeat(served)
                served.beat = served.seq

    def _abandoned(self, served: Served, now: float) -> bool:
        """Whether a parked stream's client had its chance to come back for it: a live one
        pings within moments of its own reconnection (peers get ``settle`` seconds)."""
        timeouts = self._timeouts
        assert self.nc is not None
        parked_for = now - served.parked_at
        if parked_for >= timeouts.outage:
            return True
        return bus_of(self.nc).settled(2 * timeouts.settle) and parked_for >= 2 * timeouts.settle

    async def on_control(self, msg: Msg) -> None:
        try:
            op, *args = control_codec.decode(msg.data)
        except Exception:
            logger.warning(
                "worker %s: malformed control message %r", self._outbox.worker_id, msg.data
            )
            return
        if op == wire.PING:  # [PING, inbox] or [PING, inbox, next seq]
            served = self.served.get(args[0]) if args else None
            if msg.reply and self.nc is not None:
                reply = wire.UNKNOWN if served is None else wire.KNOWN
                await quietly(self.nc.publish, msg.reply, reply)
            if served is None or self.tg is None or served.gone:
                return
            next_seq = args[1] if len(args) > 1 and isinstance(args[1], int) else None
            if (
                served.parked is None
                and served.retained is not None
                and next_seq is not None
                and next_seq < served.seq
            ):
                # Its client is behind what was sent: frames were lost (at a disconnect
                # this worker did not see, or saw too late to park them). Park, and send
                # again from where the client is.
                served.park()
            if served.parked is not None:
                # Its client is connected and subscribed again: what was held goes out.
                self.tg.start_soon(self._outbox.resume, served, next_seq)
            return
        if op == wire.DRAIN:  # [DRAIN]: a planner scales this worker down
            if msg.reply and self.nc is not None:
                await quietly(self.nc.publish, msg.reply, wire.KNOWN)
            self._on_drain()
            return
        served = self.served.get(args[-1]) if args else None
        if served is None:
            return
        if op == wire.CREDIT:  # [CREDIT, total, inbox] or [CREDIT, total, next seq, inbox]
            if isinstance(args[0], int):
                served.grant(args[0])
            if len(args) > 2 and isinstance(args[1], int):
                served.acknowledge(args[1])
        elif op == wire.KILL:
            self._outbox.client_gone(served)
        elif op == wire.STOP:
            served.stop()

    async def on_gone(self, msg: Msg) -> None:
        # A frame reached no subscriber: the client's inbox is gone (it crashed or closed).
        served = self.by_reply.get(msg.subject)
        if served is not None and (msg.headers or {}).get("Status") == "503":
            if served.parked is not None:
                return  # a frame flushed after an outage, before the client was back
            assert self.nc is not None
            if served.retained is not None and not bus_of(self.nc).settled(self._timeouts.settle):
                # Just after our own reconnection the client may not have subscribed
                # again yet: hold the stream for its ping (what it missed is retained),
                # and cut it off if it does not come back (see heartbeats).
                served.park()
                return
            self._outbox.client_gone(served)
