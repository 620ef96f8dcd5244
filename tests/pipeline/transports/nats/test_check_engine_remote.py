"""The NATS remote engine keeps the engine contract: ``check_engine`` through a real server.

The worker serves the echo and mocker engines in this process; every engine ``check_engine``
builds is a fresh ``RemoteEngine`` reaching it over NATS with the LLM codec, so stop, kill,
``n``, replayed tokens and errors all cross the wire both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from nats.aio.client import Client

from operators.contracts.transport import llm_codec
from operators.engines import EchoEngine
from operators.engines.mocker import MockerEngine
from operators.testing import check_engine
from pipeline.transports.nats import NatsTimeouts, RemoteEngine, serve

pytestmark = pytest.mark.slow  # every test starts a nats-server

ENGINES: dict[str, Callable[[], Any]] = {
    "echo": lambda: EchoEngine(cycle=True),
    "mocker": lambda: MockerEngine(prefill_ms_per_token=0.0, decode_ms_per_step=0.1),
}


@pytest.mark.parametrize("name", ENGINES)
async def test_the_remote_engine_passes(nc: Client, worker_nc: Client, name: str) -> None:
    timeouts = NatsTimeouts(ttl=1, drain=2.0)
    async with serve(
        ENGINES[name](), nc=worker_nc, model="m", codec=llm_codec(), timeouts=timeouts
    ):
        await check_engine(lambda: RemoteEngine(nc, model="m", codec=llm_codec()))
