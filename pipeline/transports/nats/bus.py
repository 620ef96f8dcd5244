"""What one process knows of its NATS connection: up or down, and since when.

While a process's own connection to the bus is down, a silent peer is not evidence of a
dead peer: its frames, pings and registrations cannot reach us either. And right after a
reconnection, a peer that has not reconnected yet is not dead either: every client
reconnects on its own timer (0.5 s apart here). So the client, the worker and discovery
ask the :class:`Bus` of their connection before they judge a peer by its silence:

* :meth:`Bus.settled` — connected, and for at least ``settle`` seconds
  (``NatsTimeouts.settle``) since the last reconnection: silence means what it used to
  mean again;
* :meth:`Bus.disturbed_since` — whether the connection went down or came back since a
  moment (a ping sent before a reconnection proves nothing either way);
* :meth:`Bus.down_for` — how long the current outage has lasted (an outage is ridden
  out for ``NatsTimeouts.outage`` seconds at most, and never past a request's deadline).

State is read off the client itself (``is_connected`` and its reconnection count), so a
connection made by the user's own code works as well as one from :func:`.connect`; the
callbacks :func:`.connect` installs add the two log lines an outage deserves (one when
the connection is lost, one when it is back, with the outage's length), and let what must
act on a reconnection (renew a watch, ask for snapshots) be told of it
(:meth:`Bus.on_reconnection`) instead of looking every fraction of a second, which is
what an idle process would otherwise spend its CPU on. On a connection made elsewhere
nobody tells the Bus, so those look again every :data:`RECONNECT_POLL` seconds
(:attr:`Bus.informed` says which).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, final

import anyio
import nats.errors

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ("POLL", "RECONNECT_POLL", "Bus", "bus_of")

logger = logging.getLogger("pipeline.transports.nats")

#: how often (seconds) something waiting for the bus looks again
POLL: Final = 0.05
#: on a connection whose Bus is not told of reconnections (not made by :func:`.connect`),
#: how often (seconds) what must act on one looks for it
RECONNECT_POLL: Final = 0.25

_BUSES: weakref.WeakKeyDictionary[Client, Bus] = weakref.WeakKeyDictionary()
#: what nats-py reports when the connection itself is lost (before it says disconnected)
_CONNECTION_LOST = (
    nats.errors.UnexpectedEOF,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionClosedError,
    OSError,
)


def bus_of(nc: Client) -> Bus:
    """The :class:`Bus` of ``nc`` (one per connection)."""
    bus = _BUSES.get(nc)
    if bus is None:
        bus = _BUSES[nc] = Bus(nc)
    return bus


@final
class Bus:
    """The state of one NATS connection, as its users need it (see the module docstring).

    Reading it costs two attribute reads while nothing happens; it is refreshed by every
    read, so no task watches it.
    """

    __slots__ = (
        "__weakref__",
        "_connected_once",
        "_down_since",
        "_listeners",
        "_lost_at",
        "_nc",
        "_reconnects",
        "_up_since",
        "informed",
        "last_error",
    )

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._reconnects: int = nc.stats["reconnects"]
        self._down_since: float | None = None  # time.monotonic() when first seen down
        self._up_since = -float("inf")  # when last seen back (never: settled from the start)
        self._lost_at = 0.0  # when nats-py last reported the connection lost
        self._connected_once = nc.is_connected
        #: what nats-py last reported through the error callback :func:`.connect` installs
        #: (a permissions violation arrives only there, apart from what it made fail)
        self.last_error: str | None = None
        #: whether nats-py tells this Bus of reconnections (:func:`.connect` made the
        #: connection): then :meth:`on_reconnection` callbacks are all it takes to hear of
        #: one; otherwise look at :attr:`reconnections` every :data:`RECONNECT_POLL` seconds
        self.informed = False
        self._listeners: list[Callable[[], None]] = []

    def _observe(self) -> None:
        nc = self._nc
        connected = nc.is_connected
        if not self._connected_once:
            # Not connected yet: the first connection is no reconnection, and is settled.
            if connected:
                self._connected_once = True
                self._reconnects = nc.stats["reconnects"]
            return
        reconnects = nc.stats["reconnects"]
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            self._up_since = time.monotonic()
            self._down_since = None
        if not connected:
            if self._down_since is None:
                self._down_since = time.monotonic()
        elif self._down_since is not None:
            # Seen down, now up (the count rises before the connection is usable, so a
            # read can fall in between): settle from now.
            self._down_since = None
            self._up_since = time.monotonic()

    @property
    def connected(self) -> bool:
        """Whether the connection is up now."""
        self._observe()
        return self._down_since is None

    @property
    def reconnections(self) -> int:
        """How many times the connection came back so far (it changes at each one)."""
        self._observe()
        return self._reconnects

    def on_reconnection(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` after each reconnection, once nats-py has subscribed again
        (only when :attr:`informed`); returns what stops it. It runs in nats-py's
        reconnection task: it must be quick (set an event)."""
        self._listeners.append(callback)

        def stop() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return stop

    async def next_reconnection(self, seen: int) -> int:
        """Wait until :attr:`reconnections` is no longer ``seen``; the new count."""
        while (count := self.reconnections) == seen:
            if not self.informed:
                await anyio.sleep(RECONNECT_POLL)
                continue
            back = anyio.Event()
            stop = self.on_reconnection(back.set)
            try:
                if self.reconnections == seen:
                    await back.wait()
            finally:
                stop()
        return count

    def settled(self, settle: float) -> bool:
        """Up, and for at least ``settle`` seconds: a silent peer is silent for real."""
        self._observe()
        return self._down_since is None and time.monotonic() - self._up_since >= settle

    def down_for(self) -> float:
        """Seconds since the connection was first seen down (0 while it is up)."""
        self._observe()
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def disturbed_since(self, moment: float, settle: float) -> bool:
        """Whether the connection is unsettled now, or went down or came back after
        ``moment`` (a ``time.monotonic()`` value)."""
        return not self.settled(settle) or self._up_since >= moment

    async def wait_settled(self, settle: float, limit: float) -> bool:
        """Wait until :meth:`settled`, for at most ``limit`` seconds of outage; False when
        the connection stayed down that long."""
        while not self.settled(settle):
            if self.down_for() >= limit:
                return False
            await anyio.sleep(POLL)
        return True

    # -- what :func:`.connect` installs as nats-py's callbacks: two log lines an outage

    async def on_disconnected(self) -> None:
        # A connection that was lost had been up, even if nobody looked at it meanwhile
        # (a worker hit by an outage before its first heartbeat round).
        self._connected_once = True
        self._observe()
        if not self._nc.is_closed:
            self._lost_at = time.monotonic()
            logger.warning("lost the NATS connection; reconnecting")

    async def on_reconnected(self) -> None:
        self._observe()
        logger.warning("the NATS connection is back after %.1fs", time.monotonic() - self._lost_at)
        for callback in list(self._listeners):
            callback()

    async def on_error(self, exc: Exception) -> None:
        self.last_error = str(exc) or type(exc).__name__
        # One per failed reconnection attempt while the server is away, and the lost
        # connection itself: the outage is logged once when it begins and once when it
        # ends.
        if self._nc.is_connected and not isinstance(exc, _CONNECTION_LOST):
            logger.warning("NATS: %r", exc)
        else:
            logger.debug("NATS: %r", exc)
