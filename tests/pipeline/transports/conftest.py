"""Fixtures for the transport tests: a real nats-server per test, and clients of it.

Nothing here imports nats at import time: a conftest cannot skip, so without the nats
extra it must load quietly and let each test module's ``pytest.importorskip`` skip it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from nats.aio.client import Client

    from tests.helpers.nats_server import NatsServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream on a random loopback port, stopped after the test."""
    from tests.helpers.nats_server import NatsServer

    server = NatsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The frontend's connection."""
    from tests.helpers.nats_server import connect

    client = await connect(nats_server)
    yield client
    await client.close()


@pytest.fixture
async def worker_nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The workers' connection (a separate client, as if another process)."""
    from tests.helpers.nats_server import connect

    client = await connect(nats_server)
    yield client
    await client.close()
