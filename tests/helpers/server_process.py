"""Run ``llm-pipeline serve`` as a real subprocess for black-box tests.

The server is started with ``--port 0`` and the test reads the real port from the line it
prints when it listens. Its stderr goes to a file, so a chatty server never blocks on a
full pipe and a test can assert on it afterwards (no traceback).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, NoReturn

__all__ = ("ServerProcess", "run_cli")

#: the repository's root: ``run_cli`` runs there, so the project and ``tests`` import
ROOT = Path(__file__).resolve().parents[2]

_BANNER = re.compile(r"llm-pipeline serving model '(?P<model>[^']*)' on (?P<url>http://\S+)")


class ServerProcess:
    """One ``llm-pipeline serve`` subprocess; ``url`` is its base URL once started."""

    def __init__(self, *options: str, startup_timeout: float = 30.0) -> None:
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # closed in stop()
        self._last_stderr = ""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "operators.cli", "serve", "--port", "0", *options],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self._read_banner(startup_timeout)
        match = _BANNER.search(line)
        if match is None:
            self.stop()
            raise RuntimeError(f"unexpected banner {line!r}; stderr: {self.stderr()}")
        self.url: str = match["url"]
        self.model: str = match["model"]

    def _read_banner(self, timeout: float) -> str:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                self._fail(f"server did not start within {timeout}s")
        line = self.process.stdout.readline().decode()
        if not line:
            self._fail("server exited at startup")
        return line

    def _fail(self, what: str) -> NoReturn:
        stopped = self.process.poll() is not None
        self.stop()  # closes the stderr file: read it first
        raise RuntimeError(f"{what}{'' if stopped else ' (stopped it)'}: {self._last_stderr}")

    @property
    def base_url(self) -> str:
        """The OpenAI API root (``.../v1``)."""
        return f"{self.url}/v1"

    def stderr(self) -> str:
        """Everything the server wrote to stderr so far (after stop(): all it wrote)."""
        if self._stderr.closed:
            return self._last_stderr
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def terminate(self, signum: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send ``signum`` and wait for the exit code."""
        self.process.send_signal(signum)
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Stop the server however it takes, and release its files."""
        if not self._stderr.closed:
            self._last_stderr = self.stderr()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


def run_cli(args: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``llm-pipeline ARGS`` to completion (for --help and argument errors)."""
    return subprocess.run(
        [sys.executable, "-m", "operators.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        check=False,
    )
