"""The planner's own HTTP port: ``/metrics``, ``/status`` and ``/health``.

::

    GET /metrics   the planner's Prometheus series (:mod:`.metrics`)
    GET /status    its status document (JSON: targets, workers, last changes per pool)
    GET /health    {"status": "ok"}

Nothing here is secret (no prompt, no key), and nothing can be changed through it. A small
ASGI app run by uvicorn on the planner's event loop; the socket is bound first, so a busy
port is one clear error (:class:`CannotListen`) and ``--port 0`` knows its port at once.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, Final, final

import orjson
import uvicorn

from .metrics import CONTENT_TYPE, PlannerMetrics

__all__ = ("CannotListen", "PlannerApp", "listen", "serve_http")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_JSON: Final = b"application/json"


class CannotListen(OSError):
    """The planner's host and port cannot be listened on (busy, or not an address here)."""


@final
class PlannerApp:
    """The ASGI app of the planner's port."""

    def __init__(self, metrics: PlannerMetrics, status: Callable[[], Any]) -> None:
        self._metrics = metrics
        self._status = status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method not in ("GET", "HEAD"):
            await _send(send, 405, _JSON, b'{"error": "only GET"}', head=False)
            return
        head = method == "HEAD"
        if path == "/metrics":
            await _send(send, 200, CONTENT_TYPE.encode(), self._metrics.render(), head=head)
        elif path == "/status":
            await _send(send, 200, _JSON, orjson.dumps(self._status()), head=head)
        elif path == "/health":
            await _send(send, 200, _JSON, b'{"status": "ok"}', head=head)
        else:
            await _send(send, 404, _JSON, b'{"error": "not found"}', head=head)


async def _send(send: Send, status: int, content_type: bytes, body: bytes, *, head: bool) -> None:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host`` and ``port`` (0: a free one).

    Raises:
        CannotListen: naming both, when they cannot be listened on.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, protocol, _, address = infos[0]
        sock = socket.socket(family, kind, protocol)
    except OSError as exc:
        raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, minus its signal handling (the planner owns the signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(app: PlannerApp, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Serve ``app`` on ``sock`` until cancelled (the socket is closed then)."""
    config = uvicorn.Config(app, loop="none", lifespan="off", log_level=log_level, access_log=False)
    server = _Server(config)
    try:
        await server.serve(sockets=[sock])
    finally:
        for listener in server.servers:
            listener.close()
        sock.close()
