"""The ASGI plumbing every edge shares: reading bodies, writing JSON, a request's identity.

Kept apart from the app's dispatch (:mod:`.app`) and from the SSE writer (:mod:`.sse_writer`):
the ASGI callable types, the body reader (bounded, notices a client that left), the one-shot
JSON response and the request's identity (``x-request-id`` and the headers that reach
``ctx.metadata``). What an error is, is :mod:`.failures`; how it is said, each edge's.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final, TypeAlias

from pipeline import Context, InvalidRequest

__all__ = (
    "JSON_HEADER",
    "SESSION_AFFINITY",
    "BodyTooLarge",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "conversation_key",
    "id_header",
    "kill_on_disconnect",
    "read_body",
    "request_identity",
    "send_json",
)

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]

JSON_HEADER: Final = (b"content-type", b"application/json")
#: the header naming a request's conversation (as ``prompt_cache_key`` does in a body)
SESSION_AFFINITY: Final = "x-session-affinity"
#: the longest conversation key (the schema's ``MAX_CONVERSATION_KEY``)
_MAX_CONVERSATION_KEY: Final = 1024
#: what a client's ``x-request-id`` may look like (it becomes the request's id)
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: request headers kept out of ``ctx.metadata`` (secrets)
_PRIVATE_HEADERS: Final = frozenset({"authorization", "cookie", "proxy-authorization", "x-api-key"})


class BodyTooLarge(Exception):
    """The request body is over the limit (a 413)."""


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise BodyTooLarge
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def kill_on_disconnect(receive: Receive, ctx: Context[Any]) -> None:
    """Kill ``ctx`` when the client disconnects; cancelled once the response is complete."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ctx.kill()
            return


async def send_json(
    send: Send, status: int, body: bytes, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """A whole JSON response: its head and its body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [JSON_HEADER, (b"content-length", b"%d" % len(body)), *extra_headers],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def request_identity(scope: Scope) -> tuple[str | None, dict[str, str]]:
    """The client's ``x-request-id`` (None if it sent none) and the headers for
    ``ctx.metadata`` (lower-case names; credentials left out).

    Raises:
        InvalidRequest: an ``x-request-id`` that is not 1-128 of ``A-Za-z0-9._:-``.
    """
    metadata: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin-1").lower()
        if name not in _PRIVATE_HEADERS:
            metadata[name] = raw_value.decode("latin-1")
    request_id = metadata.get("x-request-id")
    if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest(
            "the x-request-id header must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
            param="x-request-id",
        )
    return request_id, metadata


def conversation_key(metadata: Mapping[str, str]) -> str | None:
    """The conversation the ``x-session-affinity`` header names (None: none).

    Raises:
        InvalidRequest: an empty one, or one over 1024 characters.
    """
    key = metadata.get(SESSION_AFFINITY)
    if key is not None and not 0 < len(key) <= _MAX_CONVERSATION_KEY:
        raise InvalidRequest(
            f"the {SESSION_AFFINITY} header must be 1 to {_MAX_CONVERSATION_KEY} characters",
            param=SESSION_AFFINITY,
        )
    return key


def id_header(ctx: Context[Any]) -> tuple[tuple[bytes, bytes]]:
    """The ``x-request-id`` response header of ``ctx``."""
    return ((b"x-request-id", ctx.id.encode()),)
