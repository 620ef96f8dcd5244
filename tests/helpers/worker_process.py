"""Run ``llm-pipeline worker`` as a real subprocess, for tests and benchmarks over NATS.

Its stderr goes to a file (a chatty worker never blocks on a full pipe; a test asserts on
its log afterwards); :meth:`WorkerProcess.wait_ready` reads the line it prints once it is
registered.
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import sys
import tempfile
from typing import IO

__all__ = ("WorkerProcess",)

_READY = re.compile(
    r"llm-pipeline worker (?P<id>\S+) serving model '(?P<model>[^']*)' as (?P<role>\w+) "
    r"via (?P<url>nats://\S+)"
)


class WorkerProcess:
    """One ``llm-pipeline worker`` subprocess; :meth:`wait_ready` reads its ready line."""

    def __init__(self, url: str, worker_id: str, *options: str) -> None:
        self.worker_id = worker_id
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "operators.cli",
                "worker",
                "--nats",
                url,
                "--worker-id",
                worker_id,
                "--log-level",
                "info",
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.ready_line = ""

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        """Wait for the ready line (printed once the worker is registered)."""
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise RuntimeError(f"worker not ready within {timeout}s: {self.stderr()}")
        self.ready_line = self.process.stdout.readline().decode()
        match = _READY.search(self.ready_line)
        if match is None or match["id"] != self.worker_id:
            raise RuntimeError(f"unexpected ready line {self.ready_line!r}: {self.stderr()}")
        return self

    def stderr(self) -> str:
        """Everything the worker logged so far."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def served(self) -> list[tuple[str, str]]:
        """(request id, how it ended) for every request the worker logged as over."""
        return re.findall(r"request (\S+) (finished|stopped|cancelled|failed)", self.stderr())

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float = 15.0) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Stop the worker however it takes, and release its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()
