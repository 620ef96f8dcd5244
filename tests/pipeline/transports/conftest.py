"""Fixtures for the transport tests: a real nats-server per test, and clients of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats_server import NatsServer, connect


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream on a random loopback port, stopped after the test."""
    server = NatsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The frontend's connection."""
    client = await connect(nats_server)
    yield client
    await client.close()


@pytest.fixture
async def worker_nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The workers' connection (a separate client, as if another process)."""
    client = await connect(nats_server)
    yield client
    await client.close()
