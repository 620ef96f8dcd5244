"""The listening sockets :func:`~.runner.serve` serves on: :func:`listen`, and
:class:`CannotListen` when a host and port cannot be had.

Bound here rather than by uvicorn: uvicorn logs a bind failure and exits the process
(``sys.exit`` from inside the caller's task group, which then ends in an unrelated
``AttributeError``), whereas a caller wants one error naming the host and port (the command
line says it in one line and exits with code 2).
"""

from __future__ import annotations

import socket
from typing import final

__all__ = ("CannotListen", "listen")


@final
class CannotListen(OSError):
    """:func:`listen` cannot listen on its host and port (in use, not allowed, no such
    address); the message names both and the system's reason, ``errno`` is the system's."""


def listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on ``host`` and ``port``, one per address the host names (as
    asyncio's ``create_server`` binds them: ``SO_REUSEADDR``, IPv6 sockets IPv6 only).

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
