"""The web UI at ``GET /``: a chat playground and a status view, served by the HTTP edge.

Static files shipped in the package (``operators/data/ui``: plain HTML, CSS and
JavaScript, no build step, nothing fetched from elsewhere), and one JSON endpoint,
``GET /status``, which the status view polls: workers and their roles, requests in flight
and waiting, the KV hit rate, tokens generated, and the last requests with their stages'
spans (:class:`operators.telemetry.SpanBuffer`).

:class:`~.pages.WebUI` is what :class:`~operators.edges.openai.server.OpenAIApp` calls for
the GET paths the API does not serve. The page itself holds nothing protected: with API
keys it asks for one and keeps it in the tab's ``sessionStorage``, and every API call, the
status endpoint included, needs it.
"""

from __future__ import annotations

from .pages import STATUS_PATH, UI_FILES, WebUI, attach_ui
from .status import StatusReport, WorkerGroups, worker_rows

__all__ = (
    "STATUS_PATH",
    "UI_FILES",
    "StatusReport",
    "WebUI",
    "WorkerGroups",
    "attach_ui",
    "worker_rows",
)
