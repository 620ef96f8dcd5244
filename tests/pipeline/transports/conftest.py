"""Fixtures for the transport tests: a real nats-server per test, and clients of it.

Nothing here imports nats at import time: a conftest cannot skip, so without the nats
extra it must load quietly and let each test module's ``pytest.importorskip`` skip it.

The tests of ``pipeline/transports/nats/`` live in ``nats/`` here, and pytest puts this
folder on ``sys.path`` (for ``nats_server``): without nats-py, ``import nats`` would find
that folder, a namespace package, instead of failing, and the NATS tests would fail at
import instead of skipping. So when nats-py is missing, ``nats`` is made to fail to import
as an uninstalled package does.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats_server import NatsServer


_spec = importlib.util.find_spec("nats")
if _spec is not None and _spec.origin is None:  # this folder's nats/, not nats-py
    sys.modules["nats"] = None  # type: ignore[assignment]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream on a random loopback port, stopped after the test."""
    from nats_server import NatsServer

    server = NatsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The frontend's connection."""
    from nats_server import connect

    client = await connect(nats_server)
    yield client
    await client.close()


@pytest.fixture
async def worker_nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The workers' connection (a separate client, as if another process)."""
    from nats_server import connect

    client = await connect(nats_server)
    yield client
    await client.close()
