"""Serving the web UI: the page, its two assets, and the status document.

::

    GET /               index.html   (open: the page holds nothing protected)
    GET /ui/app.js      the script
    GET /ui/app.css     the styles
    GET /status         the status document (JSON; with API keys, only with one, and its
                        recent requests only the key's own unless it is an admin key)

The files are read from the package once, when the UI is built, and served from memory
with a Content-Security-Policy that lets the page load only from this server (no inline
script, nothing from elsewhere) and be framed by nobody.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, final

import orjson

from operators.edges.http.asgi import send_json
from operators.edges.http.guard import Guard
from operators.edges.openai.errors import unauthorized_body

from .status import StatusReport, WorkerGroups

if TYPE_CHECKING:
    from operators.edges.http.asgi import Receive, Scope, Send
    from operators.edges.openai.server import OpenAIApp
    from operators.telemetry import SpanBuffer

__all__ = ("STATUS_PATH", "UI_FILES", "WebUI", "attach_ui")

#: the status document's path
STATUS_PATH: Final = "/status"
#: the URL path of each file, and (its name in ``operators/data/ui``, its content type)
UI_FILES: Final[Mapping[str, tuple[str, str]]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
_SECURITY_HEADERS: Final = (
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
)


def _load() -> dict[str, tuple[bytes, bytes]]:
    folder = importlib.resources.files("operators") / "data" / "ui"
    return {
        path: ((folder / name).read_bytes(), content_type.encode())
        for path, (name, content_type) in UI_FILES.items()
    }


@final
class WebUI:
    """The ``pages`` of an :class:`~operators.edges.openai.server.OpenAIApp`: answers the
    UI's paths (None for any other), ``status()`` giving the status document.

    ``guard`` is the app's: with API keys the status document needs one, as ``/v1/*`` does,
    and lists the requests of that key only (``status(owner)``; an admin key, or a server
    without keys: ``status(None)``, every request).
    """

    __slots__ = ("_files", "_guard", "_status")

    def __init__(
        self, status: Callable[[str | None], Mapping[str, Any]], guard: Guard | None = None
    ):
        self._files = _load()
        self._status = status
        self._guard = guard if guard is not None else Guard()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int | None:
        """Serve ``scope``'s path if it is the UI's; the status code sent, or None."""
        path: str = scope["path"]
        head = scope["method"] == "HEAD"
        if path == STATUS_PATH:
            allowed, presented = self._guard.check_key(scope)
            if not allowed:
                await send_json(
                    send, 401, unauthorized_body(presented), ((b"www-authenticate", b"Bearer"),)
                )
                return 401
            guard = self._guard
            viewer = None if guard.is_admin(scope) else guard.owner(scope)
            body = orjson.dumps(self._status(viewer))
            await _send(send, body, b"application/json", head)
            return 200
        found = self._files.get(path if path != "/index.html" else "/")
        if found is None:
            return None
        body, content_type = found
        await _send(send, body, content_type, head)
        return 200

    def __repr__(self) -> str:
        return f"WebUI({sorted(self._files)})"


async def _send(send: Send, body: bytes, content_type: bytes, head: bool) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", b"%d" % len(body)),
        *_SECURITY_HEADERS,
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body, "more_body": False})


def attach_ui(
    app: OpenAIApp,
    *,
    buffer: SpanBuffer | None,
    workers: Callable[[], WorkerGroups] | None = None,
    where: str = "in-process",
    engine_name: str = "engine",
    exporting: str | None = None,
    planner: Callable[[], Mapping[str, Any] | None] | None = None,
) -> WebUI:
    """Serve the web UI from ``app`` (its ``pages``), the status view reading ``buffer``,
    ``workers`` and ``planner`` (see :class:`~.status.StatusReport`); the UI is returned."""
    status = StatusReport(
        app,
        workers=workers,
        where=where,
        engine_name=engine_name,
        buffer=buffer,
        exporting=exporting,
        planner=planner,
    )
    ui = WebUI(status, app.guard)
    app.pages = ui
    return ui
