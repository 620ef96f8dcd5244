"""A TCP forwarder between one NATS client and the server, for faults a whole-server
restart cannot make: one process's connection lost (and back at once), bytes lost on
their way, a client kept away while the others reconnect."""

from __future__ import annotations

import anyio
from anyio.abc import SocketStream, TaskStatus

__all__ = ("Proxy",)


class Proxy:
    """Forwards connections on :attr:`port` to ``127.0.0.1:target``; run it in a task group
    (``await tg.start(proxy.run)``).

    ``blackhole``: what clients send is dropped (the server never sees it), as by a
    connection that died without either side knowing yet; :meth:`cut` closes the
    connections open now; between :meth:`hold` and :meth:`release` a new connection
    waits (the client sees a server slow to greet it, not an error).
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.blackhole = False
        self._open: set[anyio.CancelScope] = set()
        self._released: anyio.Event | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            task_status.started()
            await listener.serve(self._forward)

    def hold(self) -> None:
        """New connections wait until :meth:`release`."""
        self._released = anyio.Event()

    def release(self) -> None:
        if self._released is not None:
            self._released.set()
        self._released = None

    def cut(self) -> None:
        """Close every connection open now (the clients see their connection lost)."""
        for scope in list(self._open):
            scope.cancel()

    async def _forward(self, client: SocketStream) -> None:
        async with client:
            if self._released is not None:
                await self._released.wait()
            try:
                server = await anyio.connect_tcp("127.0.0.1", self.target)
            except OSError:
                return  # the server is down: so is the connection
            async with server, anyio.create_task_group() as tg:
                self._open.add(tg.cancel_scope)
                tg.start_soon(self._pump, client, server, True, tg.cancel_scope)
                tg.start_soon(self._pump, server, client, False, tg.cancel_scope)
            self._open.discard(tg.cancel_scope)

    async def _pump(
        self, source: SocketStream, sink: SocketStream, upstream: bool, scope: anyio.CancelScope
    ) -> None:
        try:
            async for chunk in source:
                if upstream and self.blackhole:
                    continue
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        scope.cancel()  # one side closed: so does the other
