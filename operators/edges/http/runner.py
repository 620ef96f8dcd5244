"""Running an :class:`~operators.edges.http.app.EdgeApp` over HTTP: :func:`serve`.

uvicorn (httptools parser) on the running asyncio loop, with this module, not uvicorn,
owning SIGINT and SIGTERM, so a shutdown drains the app first::

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
from typing import TYPE_CHECKING, Final, final

import anyio
import uvicorn

from pipeline import EngineDead

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from .app import EdgeApp

__all__ = ("DRAIN_TIMEOUT", "EXIT_AFTER_ABORT", "CannotListen", "serve")

logger = logging.getLogger(__name__)

#: the default drain: with :data:`EXIT_AFTER_ABORT`, under Kubernetes' default 30 s grace
#: (the command line's ``--drain-timeout`` default is the same)
DRAIN_TIMEOUT: Final = 25.0
#: after the drain timeout's abort, how long the error events have to reach their clients
#: before the exit is forced
EXIT_AFTER_ABORT: Final = 3.0
#: how often a drain looks whether requests are still in flight, seconds
_DRAIN_POLL: Final = 0.05


@final
class CannotListen(OSError):
    """:func:`serve` cannot listen on its host and port (in use, not allowed, no such
    address); the message names both and the system's reason, ``errno`` is the system's."""


def _listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on ``host`` and ``port`` (one per address the host names), bound
    here rather than by uvicorn, which logs the error and exits the process instead of
    raising it.

    Raises:
        CannotListen: an address cannot be bound.
    """
    where = f"{'[' + host + ']' if ':' in host else host}:{port}"
    bound: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError as exc:
        for sock in bound:
            sock.close()
        reason = exc.strerror or str(exc)
        raise CannotListen(exc.errno, f"cannot listen on {where}: {reason}") from exc
    return bound


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
) -> None:
    """Serve ``app`` over HTTP (uvicorn, httptools) until SIGINT or SIGTERM.

    ``on_ready(host, port)`` is called once the socket listens, with the real port (so
    ``port=0`` picks a free one). On the first signal the app drains (new requests and
    ``/ready`` get 503); in-flight requests have ``drain_timeout`` seconds to finish, then
    :meth:`~.app.EdgeApp.abort` ends the rest with an error; uvicorn stops accepting once
    none is left, and the exit is forced :data:`EXIT_AFTER_ABORT` seconds after an abort
    if connections are still open.
    A second signal forces the exit. Returns normally after a signal-initiated shutdown.
    ``app.health``'s watchdog runs meanwhile.

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
        http="httptools",
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
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if shutting_down:
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

    sockets = _listen(host, port, config.backlog)
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
