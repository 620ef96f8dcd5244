"""The HTTP plumbing every API edge shares, written once.

- :mod:`.app` — :class:`~.app.EdgeApp`, the ASGI app: the edges' routes, API keys,
  ``/health`` and ``/metrics``.
- :mod:`.routes` — the edge contract: :class:`~.routes.Edge`, :class:`~.routes.Route`,
  :class:`~.routes.Call`, the :class:`~.routes.Host` (``generate``, ``read_body``,
  ``offload``), and a generation edge's halves: ``Prepare`` -> :class:`~.routes.Exchange`,
  the :class:`~.routes.Reply` that renders the graph's events.
- :mod:`.schema` — one way from a body to a request model for every edge
  (:func:`~.schema.parse_body`: unsupported fields, bounded free-form JSON, ``param``).
- :mod:`.generation` — :class:`~.generation.Generations`: a generation request's life
  (body, admission, request ids, deadlines, disconnect -> kill, the drain); a running
  request is one :class:`~.running.Running` record.
- :mod:`.sse_writer` — when a stream's bytes leave (coalesced writes, keep-alives).
- :mod:`.failures` — what went wrong, in no API's words (:class:`~.failures.ApiError`),
  and the :class:`~.failures.ErrorStyle` each edge says it in.
- :mod:`.guard`, :mod:`.metrics`, :mod:`.asgi`, :mod:`.runner` — the protections, the
  Prometheus series, the ASGI helpers, serving with uvicorn.

It knows no API: ``tests/test_layering.py`` keeps every edge out of it.
"""

from __future__ import annotations

__all__ = ()
