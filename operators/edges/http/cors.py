"""CORS: what a browser is told about the pages allowed to call the server.

A page of an allowed origin (:meth:`~.guard.Guard.origin_allowed`) gets the CORS headers on
each response's head (:func:`with_cors`: the head only, nothing per token) and its
preflights a 204 (:func:`answer_preflight`); its scripts may read the request id, ``Retry-After``
and the keys' rate-limit headers. Any other origin gets none, and the browser refuses.
"""

from __future__ import annotations

from typing import Final

from .asgi import Message, Scope, Send

__all__ = ("answer_preflight", "with_cors")

#: what a CORS preflight is told (the headers a browser may send: the SDKs' own too)
_CORS_METHODS: Final = b"GET, POST, DELETE, OPTIONS"
#: the response headers a page's scripts may read
_CORS_EXPOSED: Final = (
    b"x-request-id, retry-after, retry-after-ms, "
    b"x-ratelimit-limit-requests, x-ratelimit-remaining-requests, x-ratelimit-reset-requests, "
    b"x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens, "
    b"anthropic-ratelimit-requests-limit, anthropic-ratelimit-requests-remaining, "
    b"anthropic-ratelimit-requests-reset, anthropic-ratelimit-tokens-limit, "
    b"anthropic-ratelimit-tokens-remaining, anthropic-ratelimit-tokens-reset"
)
_CORS_MAX_AGE: Final = b"600"


def _cors_headers(origin: bytes) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin),
        (b"vary", b"origin"),
        (b"access-control-expose-headers", _CORS_EXPOSED),
    ]


def with_cors(send: Send, origin: bytes) -> Send:
    """``send``, adding the CORS headers to the response's head (only the head: nothing
    is done per token)."""

    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *_cors_headers(origin)]}
        await send(message)

    return send_with_cors


async def answer_preflight(send: Send, origin: bytes, scope: Scope) -> None:
    """A CORS preflight from an allowed origin: the methods, and the headers it asked for."""
    asked = b""
    for name, value in scope.get("headers", ()):
        if name == b"access-control-request-headers":
            asked = value
    headers = [
        *_cors_headers(origin),
        (b"access-control-allow-methods", _CORS_METHODS),
        (b"access-control-max-age", _CORS_MAX_AGE),
        (b"content-length", b"0"),
    ]
    if asked:
        headers.append((b"access-control-allow-headers", asked))
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
