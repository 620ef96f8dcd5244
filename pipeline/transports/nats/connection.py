"""The connection workers and frontends use: :func:`connect`, and two helpers around it.

:func:`connect` reconnects forever once connected (workers and frontends outlive a server
restart) and installs the callbacks of the connection's :class:`~.bus.Bus`;
:func:`settle` waits until the server has processed what was sent (``flush()`` does not
promise it); :func:`quietly` is for best-effort cleanup.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient

from pipeline.errors import ConnectFailed

from .bus import bus_of

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ("CONNECT_TIMEOUT", "connect", "quietly", "settle")

logger = logging.getLogger(__name__)

#: how long :func:`connect` tries to reach a NATS server before ConnectFailed (seconds)
CONNECT_TIMEOUT: Final = 10.0


async def connect(
    url: str | list[str], *, name: str | None = None, give_up_after: float = CONNECT_TIMEOUT
) -> Client:
    """A NATS connection for serving or discovery: once connected, it reconnects forever.

    Workers and frontends outlive server restarts (it retries every 0.5 s); a connection
    that gave up would not. An outage is logged twice: when the connection is lost, and
    when it is back (with how long it was away). The first connection, though, is
    bounded: no server at ``url`` within ``give_up_after`` seconds is a mistake to report,
    not to wait out.

    Raises:
        ConnectFailed: when no server at ``url`` accepted the connection within
            ``give_up_after`` seconds (an unreachable address, an authorization failure), or
            ``url`` is malformed; chained from nats-py's last error.
    """
    nc = NatsClient()
    bus = bus_of(nc)
    try:
        with anyio.fail_after(give_up_after):
            await nc.connect(
                url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds, annotated int
                connect_timeout=2,
                # An outage is two log lines, not one per reconnection attempt.
                error_cb=bus.on_error,
                disconnected_cb=bus.on_disconnected,
                reconnected_cb=bus.on_reconnected,
            )
    except TimeoutError as exc:
        last = nc.last_error
        await _abandon(nc)
        raise ConnectFailed(
            f"no NATS server accepted a connection at {url} within {give_up_after:g}s"
            + ("" if last is None else f" (last error: {last!r})")
        ) from (last or exc)
    except (nats.errors.Error, OSError) as exc:  # a malformed URL
        await _abandon(nc)
        raise ConnectFailed(f"cannot connect to NATS at {url}: {exc}") from exc
    _ = bus.connected  # seen up: an outage from now on is one (not a first connection)
    bus.informed = True  # its callbacks are installed: reconnections are told, not polled
    return nc


async def _abandon(nc: Client) -> None:
    """Close a client whose first connection failed (it may hold a half-open socket)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
        try:
            await nc.close()
        except Exception as exc:  # nats-py asserts when the URL never parsed
            logger.debug("closing a client that never connected: %r", exc)


async def settle(nc: Client) -> None:
    """Wait until the server has processed everything sent on ``nc`` so far.

    ``Client.flush()`` does not promise that in nats-py 2.16: its PING is written ahead of
    the commands still buffered, so a subscription made just before may not be active yet
    (measured: 27 of 300 subscribe-flush-request rounds got "no responders"). A message to
    ourselves travels behind those commands.

    Raises:
        TimeoutError: when the server does not answer within 5 seconds.
    """
    inbox = nc.new_inbox()
    arrived = anyio.Event()

    async def on_msg(msg: Msg) -> None:
        arrived.set()

    subscription = await nc.subscribe(inbox, cb=on_msg)
    try:
        await nc.publish(inbox, b"")
        with anyio.fail_after(5.0):
            await arrived.wait()
    finally:
        await quietly(subscription.unsubscribe)


async def quietly(call: Callable[..., Any], *args: Any) -> None:
    """Await ``call(*args)``, logging (not raising) NATS errors: for best-effort cleanup."""
    try:
        await call(*args)
    except nats.errors.Error as exc:
        logger.debug("ignored during cleanup: %r", exc)
