"""A helper script run as a child process (a worker a test can ``kill -9``), for tests.

The scripts (``worker_process.py``, ``kv_worker_process.py``) print a line starting with
``ready`` once they serve; :func:`ready_process` waits for it and kills what is left of the
process on exit.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from anyio.abc import Process

__all__ = ("ready_process",)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]


@asynccontextmanager
async def ready_process(script: str, *args: str) -> AsyncIterator[Process]:
    """``script`` (a file beside this one) run with ``args``, once it said it is ready."""
    process = await anyio.open_process(
        [sys.executable, str(HERE / script), *args], cwd=ROOT, stderr=None
    )
    try:
        assert process.stdout is not None
        with anyio.fail_after(15):
            line = await process.stdout.receive()
        assert line.startswith(b"ready"), line
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.fail_after(5):
            await process.wait()
        await process.aclose()
