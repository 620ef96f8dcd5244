"""Running an :class:`~operators.edges.http.app.EdgeApp` over HTTP: :func:`serve`.

uvicorn (httptools parser) on the running asyncio loop, with this module, not uvicorn,
owning SIGINT and SIGTERM, so a shutdown drains the app first::

    signal --> app.drain()          new requests get 503, in-flight ones run on
           --> uvicorn should_exit  stop accepting, close idle connections, wait for the rest
    drain_timeout later --> app.abort()  what still runs ends with a 503 error (event)
    EXIT_AFTER_ABORT later --> force exit (connections that have not closed are dropped)
    second signal --> force exit

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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

import anyio
import uvicorn

if TYPE_CHECKING:
    import socket

    from anyio.abc import TaskStatus

    from .app import EdgeApp

__all__ = ("DRAIN_TIMEOUT", "EXIT_AFTER_ABORT", "serve")

logger = logging.getLogger(__name__)

#: the default drain: with :data:`EXIT_AFTER_ABORT`, under Kubernetes' default 30 s grace
#: (the command line's ``--drain-timeout`` default is the same)
DRAIN_TIMEOUT: Final = 25.0
#: after the drain timeout's abort, how long the error events have to reach their clients
#: before the exit is forced
EXIT_AFTER_ABORT: Final = 3.0


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
    ``port=0`` picks a free one). On the first signal the app drains (new requests get
    503) and uvicorn stops accepting; in-flight requests have ``drain_timeout`` seconds to
    finish, then :meth:`~.app.EdgeApp.abort` ends the rest with an error, and the
    exit is forced :data:`EXIT_AFTER_ABORT` seconds later if connections are still open.
    A second signal forces the exit. Returns normally after a signal-initiated shutdown.

    Cancelling the task that runs it stops it at once (in-flight requests are cut, the
    listening socket is closed). Must run on an asyncio event loop; uvloop is recommended
    (and sets TCP_NODELAY).
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

    async def abort_after_drain() -> None:
        await anyio.sleep(drain_timeout)
        if app.inflight:
            logger.warning(
                "drain timeout (%g s): ending %d requests still in flight",
                drain_timeout,
                app.inflight,
            )
            app.abort()
            await anyio.sleep(EXIT_AFTER_ABORT)
            if not server.force_exit:
                logger.warning(
                    "connections still open %g s after the drain: forcing the exit",
                    EXIT_AFTER_ABORT,
                )
                server.force_exit = True

    async def shut_down_on_signals(*, task_status: TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if server.should_exit:
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
                    app.drain()
                    server.should_exit = True
                    tg.start_soon(abort_after_drain)

    async with anyio.create_task_group() as tg:
        if handle_signals:
            # Handlers are in place before the socket listens (and before on_ready).
            await tg.start(shut_down_on_signals)
        try:
            await server.serve()
        finally:
            # Cancelled from outside (a caller stopping us): uvicorn's shutdown did not run,
            # so its listening sockets are still open. Closing them is synchronous.
            for listener in server.servers:
                listener.close()
        tg.cancel_scope.cancel()
