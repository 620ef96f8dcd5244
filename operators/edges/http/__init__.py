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
- :mod:`.admission` — one admission for every edge: a key's limits, a slot of
  ``max_inflight`` or a fair wait for one, tokens reserved and settled; over
  :mod:`.tenants` (the keys and their terms), :mod:`.limits` (the bucket arithmetic),
  :mod:`.reservation` (the tokens a request may use),
  :mod:`.budgets` / :mod:`.nats_budgets` (where each key's use is kept),
  :mod:`.fair_queue` (who goes first), :mod:`.ledger` and :mod:`.usage` (each key's usage,
  ``GET /v1/usage``).
- :mod:`.guard`, :mod:`.metrics`, :mod:`.asgi`, :mod:`.cors`, :mod:`.runner` — the
  protections, the Prometheus series, the ASGI helpers, CORS, serving with uvicorn.

It knows no API: ``tests/test_layering.py`` keeps every edge out of it.
"""

from __future__ import annotations

__all__ = ()
