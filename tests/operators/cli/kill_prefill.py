"""An operator for fault tests: it kills the prefill worker the moment a request carries
its transfer handle, before the decode worker can pull the KV.

Inserted before the engine (``serve --insert-before
engine=tests.operators.cli.kill_prefill:KillPrefill``), it sees every request the
PrefillRouter sends to decode. The first one with a handle makes it ``kill -9`` the process
whose pid is in ``$LLM_PIPELINE_TEST_KILL_PID`` and wait until the handle's address refuses
connections (the process is gone), then pass the request on.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import anyio

from pipeline import Context, Engine, Stream


class KillPrefill:
    def __init__(self) -> None:
        self.killed = False

    async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
        handle = getattr(ctx.data, "prefill_result", None)
        if handle is not None and not self.killed:
            self.killed = True
            os.kill(int(os.environ["LLM_PIPELINE_TEST_KILL_PID"]), signal.SIGKILL)
            await anyio.to_thread.run_sync(_wait_refused, str(handle["address"]))
        async for output in downstream.generate(ctx):
            yield output


def _wait_refused(address: str, within: float = 10.0) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{address} still accepts connections")
