"""Running an :class:`~operators.edges.http.app.EdgeApp` over HTTP: :func:`serve`.

uvicorn (httptools parser) on the running asyncio loop, with this module, not uvicorn,
owning SIGINT and SIGTERM, so a shutdown drains the app first::

    SIGHUP --> on_hangup()          (when given: the keys file reloaded, nothing dropped)
    signal --> app.drain()          new requests get 503, /ready 503, in-flight ones run on
    no request in flight (or drain_timeout later: app.abort(), what still runs ends
           with a 503 error event) --> uvicorn should_exit: stop accepting, close idle
           connections, wait for the rest
    EXIT_AFTER_ABORT after an abort --> force exit (connections not closed are dropped)
    second signal --> force exit
    an engine dead beyond recovery (app.health) --> the same drain, then EngineDead

The app's health (:mod:`pipeline.health`) is judged here too: :func:`serve` runs its
watchdog, and when an engine the process hosts is dead beyond recovery (``/live`` says
503 from then on) it logs one line naming why, drains as for a signal and raises
:class:`~pipeline.EngineDead`, so the process exits non-zero and its supervisor starts a
fresh one. A host and port that cannot be listened on is :class:`CannotListen`, one error
naming both (uvicorn would log it and exit).

The socket listens on through the drain, so an orchestrator's probes see ``/ready`` turn
503 (and its load balancer take the server out) while the requests in flight finish,
rather than a refused connection; new generation requests get a 503 meanwhile.

A stream is never ended with a finish reason it did not earn: it either finishes within
the drain timeout or gets an error event, so a client can tell a cut answer from a whole
one. The process is gone at most :data:`EXIT_AFTER_ABORT` seconds after the drain timeout,
so ``drain_timeout`` plus that is what to fit in a supervisor's grace period (Kubernetes:
``terminationGracePeriodSeconds``, 30 s by default, then SIGKILL).

A request's line and headers are bounded (``max_header_bytes``, 64 KiB by default): past the
bound the connection gets a 431 and is closed before the rest is read. httptools (llhttp)
sets no bound of its own and buffers a header however long, so the protocol counts the
bytes it feeds the parser until the head ends (:func:`bounded_protocol`).

Streams never wait on Nagle's algorithm: uvicorn writes the response head and each event
in separate ``transport.write`` calls, and uvloop sets TCP_NODELAY on every accepted
socket, so a reused connection gets its first token without the ~40 ms delayed-ACK stall.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

import anyio
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeline import EngineDead

from .failures import headers_too_large
from .listen import CannotListen, listen

if TYPE_CHECKING:
    import asyncio

    from anyio.abc import TaskStatus

    from .app import EdgeApp

__all__ = (
    "DRAIN_TIMEOUT",
    "EXIT_AFTER_ABORT",
    "MAX_HEADER_BYTES",
    "CannotListen",
    "bounded_protocol",
    "serve",
)

logger = logging.getLogger(__name__)

#: the default drain: with :data:`EXIT_AFTER_ABORT`, under Kubernetes' default 30 s grace
#: (the command line's ``--drain-timeout`` default is the same)
DRAIN_TIMEOUT: Final = 25.0
#: after the drain timeout's abort, how long the error events have to reach their clients
#: before the exit is forced
EXIT_AFTER_ABORT: Final = 3.0
#: how often a drain looks whether requests are still in flight, seconds
_DRAIN_POLL: Final = 0.05
#: the most bytes a request's line and headers may take (``--max-header-bytes``)
MAX_HEADER_BYTES: Final = 64 * 1024
_HEAD_END: Final = b"\r\n\r\n"


def bounded_protocol(limit: int, refusal: bytes) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, answering ``refusal`` (a whole HTTP response) and
    closing the connection once a request's head (its line and headers) passes ``limit``
    bytes.

    The bytes are counted as they arrive, before the parser sees them (llhttp buffers a
    header of any length: a 64 MiB one stalled the server for seconds); a chunk that ends
    the head counts up to the blank line only, so a body sent with the head is not taken
    for headers.
    """

    class BoundedHead(HttpToolsProtocol):
        _in_head = True
        _head_bytes = 0
        _tail = b""

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes, self._tail = False, 0, b""
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                seen = self._tail + data
                end = seen.find(_HEAD_END)
                counted = len(data) if end < 0 else max(0, end + 4 - len(self._tail))
                self._head_bytes += counted
                self._tail = seen[-3:]
                if self._head_bytes > limit:
                    self.transport.write(refusal)
                    self.transport.close()
                    return
            super().data_received(data)

    return BoundedHead


def _refusal(app: EdgeApp, limit: int) -> bytes:
    """The 431 response, whole, in the app's error style."""
    rendered = app.errors.render(headers_too_large(limit))
    head = [
        b"HTTP/1.1 431 Request Header Fields Too Large",
        b"content-type: application/json",
        b"content-length: %d" % len(rendered.body),
        b"connection: close",
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + rendered.body


class _Server(uvicorn.Server):
    """uvicorn's server, minus its signal handling (:func:`serve` owns the signals)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str, int], object]) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(host, port)


async def serve(
    app: EdgeApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[str, int], object] = lambda host, port: None,
    drain_timeout: float = DRAIN_TIMEOUT,
    handle_signals: bool = True,
    log_level: str = "warning",
    max_header_bytes: int = MAX_HEADER_BYTES,
    on_hangup: Callable[[], object] | None = None,
) -> None:
    """Serve ``app`` over HTTP (uvicorn, httptools) until SIGINT or SIGTERM.

    ``on_ready(host, port)`` is called once the socket listens, with the real port (so
    ``port=0`` picks a free one). On the first signal the app drains (new requests and
    ``/ready`` get 503); in-flight requests have ``drain_timeout`` seconds to finish, then
    :meth:`~.app.EdgeApp.abort` ends the rest with an error; uvicorn stops accepting once
    none is left, and the exit is forced :data:`EXIT_AFTER_ABORT` seconds after an abort
    if connections are still open. A second signal forces the exit. A request whose line
    and headers are over ``max_header_bytes`` gets a 431 and its connection is closed.
    With ``on_hangup``, a SIGHUP calls it (and serving goes on). Returns normally after a
    signal-initiated shutdown. ``app.health``'s watchdog runs meanwhile.

    Cancelling the task that runs it stops it at once (in-flight requests are cut, the
    listening socket is closed). Must run on an asyncio event loop; uvloop is recommended
    (and sets TCP_NODELAY).

    Raises:
        CannotListen: ``host`` and ``port`` cannot be listened on (one error, naming them).
        EngineDead: an engine the app hosts died beyond recovery (after the drain).
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=bounded_protocol(max_header_bytes, _refusal(app, max_header_bytes)),
        loop="none",
        lifespan="off",
        log_level=log_level,
        access_log=False,
        # uvicorn's own limit comes after ours, so that it finds nothing left to cut
        timeout_graceful_shutdown=math.ceil(drain_timeout) + 5,
    )
    server = _Server(config, on_ready)
    dead: list[str] = []

    shutting_down = False

    async def drain() -> None:
        with anyio.move_on_after(drain_timeout):
            while app.inflight:  # noqa: ASYNC110 - requests end in their own tasks
                await anyio.sleep(_DRAIN_POLL)
        if not app.inflight:
            server.should_exit = True
            return
        logger.warning(
            "drain timeout (%g s): ending %d requests still in flight",
            drain_timeout,
            app.inflight,
        )
        app.abort()
        server.should_exit = True
        await anyio.sleep(EXIT_AFTER_ABORT)
        if not server.force_exit:
            logger.warning(
                "connections still open %g s after the drain: forcing the exit",
                EXIT_AFTER_ABORT,
            )
            server.force_exit = True

    def shut_down() -> None:
        nonlocal shutting_down
        shutting_down = True
        app.drain()
        tg.start_soon(drain)

    async def shut_down_on_signals(*, task_status: TaskStatus[None]) -> None:
        wanted = (signal.SIGINT, signal.SIGTERM, *(() if on_hangup is None else (signal.SIGHUP,)))
        with anyio.open_signal_receiver(*wanted) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    assert on_hangup is not None
                    on_hangup()
                elif shutting_down:
                    logger.warning("second %s: forcing the exit", signal.Signals(signum).name)
                    app.abort()
                    server.force_exit = True
                else:
                    logger.info(
                        "%s: shutting down (%d in flight, drain timeout %g s)",
                        signal.Signals(signum).name,
                        app.inflight,
                        drain_timeout,
                    )
                    shut_down()

    async def shut_down_when_dead() -> None:
        why = await app.health.wait_dead()
        dead.append(why)
        if not shutting_down:
            logger.error("an engine is dead beyond recovery, exiting after the drain: %s", why)
            shut_down()

    sockets = listen(host, port, config.backlog)
    try:
        async with anyio.create_task_group() as tg:
            if handle_signals:
                # Handlers are in place before the socket listens (and before on_ready).
                await tg.start(shut_down_on_signals)
            await tg.start(app.health.run)
            tg.start_soon(shut_down_when_dead)
            try:
                await server.serve(sockets=sockets)
            finally:
                # Cancelled from outside (a caller stopping us): uvicorn's shutdown did not
                # run, so its listening sockets are still open. Closing them is synchronous.
                for listener in getattr(server, "servers", ()):
                    listener.close()
            tg.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
    if dead:
        raise EngineDead(f"an engine is dead beyond recovery: {dead[0]}")
