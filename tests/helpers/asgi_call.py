"""One request straight through an ASGI app, without a server or an HTTP client between
(whose own objects would be measured with the app's, or hide what the app sends)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import anyio
import orjson

from operators.edges.http.asgi import Scope

__all__ = ("call_asgi",)


async def call_asgi(
    app: Any, path: str, body: dict[str, Any], disconnect: anyio.Event | None = None
) -> list[dict[str, Any]]:
    """Run one request through the app and return every ASGI message it sent.

    The client "disconnects" when ``disconnect`` is set (never, if it is None).
    """
    sent: list[dict[str, Any]] = []
    requested = False
    gone = disconnect if disconnect is not None else anyio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    return sent
