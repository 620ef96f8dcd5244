"""The Bus: what a process knows of its own NATS connection, as its streams need it.

Driven with a stand-in for nats-py's client (the three things the Bus reads), so each
moment of a connection's life can be set exactly; the real outages are in
``tests/operators/cli/test_cli_nats_faults.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from pipeline.transports.nats.bus import Bus


class Connection:
    """What the Bus reads of nats-py's ``Client``."""

    def __init__(self) -> None:
        self.is_connected = False
        self.is_closed = False
        self.stats: dict[str, Any] = {"reconnects": 0}


async def test_a_connection_lost_before_anyone_looked_at_it_is_down() -> None:
    # Once, a worker whose bus was lost within its first heartbeat round took the outage
    # for a settled connection, and gave its parked streams up 4 s into it.
    connection = Connection()
    bus = Bus(connection)  # (made before the connection is, as connect() does)
    connection.is_connected = True  # up, and nobody looks
    connection.is_connected = False
    await bus.on_disconnected()
    assert not bus.connected
    assert not bus.settled(0.0)
    assert bus.disturbed_since(0.0, 2.0)


async def test_a_first_connection_is_settled_and_a_reconnection_settles_later() -> None:
    connection = Connection()
    bus = Bus(connection)
    connection.is_connected = True
    assert bus.connected
    assert bus.settled(2.0)  # the first connection is no reconnection
    connection.is_connected = False
    await bus.on_disconnected()
    assert not bus.connected
    connection.is_connected = True
    connection.stats["reconnects"] = 1
    await bus.on_reconnected()
    assert bus.connected
    assert bus.settled(0.0)
    assert not bus.settled(2.0)  # its peers get time to come back
