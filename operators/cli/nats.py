"""Connecting ``serve --nats`` and ``worker`` to NATS, and keeping nats-py's logs short.

Failures to connect are the user's to fix (a wrong URL, no server yet), so they are one
line on stderr and an exit code, never a traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import anyio

from .defaults import NATS_CONNECT_TIMEOUT

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ("OneLineErrors", "close_nats", "connect_nats")

logger = logging.getLogger(__name__)


async def connect_nats(url: str, *, name: str) -> Client | None:
    """A NATS client that reconnects forever once connected; None (said on stderr) when no
    server accepted the connection at ``url`` within :data:`NATS_CONNECT_TIMEOUT` seconds.
    """
    from pipeline import ConnectFailed
    from pipeline.transports.nats import connect

    try:
        return await connect(url, name=name, give_up_after=NATS_CONNECT_TIMEOUT)
    except ConnectFailed as exc:
        print(f"llm-pipeline: {exc}", file=sys.stderr)
        return None


async def close_nats(nc: Client) -> None:
    """Close ``nc`` (shielded, at most 2 s: a server that went away must not hang exit)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
        try:
            await nc.close()
        except Exception as exc:  # closing a connection to a server that went away
            logger.debug("closing the NATS connection: %r", exc)


class OneLineErrors(logging.Filter):
    """Turns nats-py's "encountered error" tracebacks (one per failed reconnection attempt
    while the server is away) into one-line warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]!r}"
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True
