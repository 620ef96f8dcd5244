"""A helper script run as a child process (a worker a test can ``kill -9``), for tests.

The scripts (``worker_process``, ``kv_worker_process``, run with ``python -m`` from the
repository's root) print a line starting with ``ready`` once they serve;
:func:`ready_process` waits for it and kills what is left of the process on exit.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from anyio.abc import Process

__all__ = ("ready_process",)

#: the repository's root, where ``python -m`` finds the scripts (and the project)
ROOT = Path(__file__).resolve().parents[4]


@asynccontextmanager
async def ready_process(module: str, *args: str) -> AsyncIterator[Process]:
    """``python -m module args``, once it said it is ready."""
    process = await anyio.open_process([sys.executable, "-m", module, *args], cwd=ROOT, stderr=None)
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
