"""What ``GET /status`` answers: the server at a glance, for the status view.

Read when asked (the page polls every two seconds while the view is open): nothing is
counted for it beyond what the metrics and the span buffer already hold. ::

    {"model": "echo", "uptime_s": 12.5, "draining": false,
     "in_flight": 1, "waiting": 0,
     "requests_total": 40, "output_tokens_total": 5120,
     "kv": {"hit_blocks": 10, "miss_blocks": 30, "hit_rate": 0.25, "source": "router"},
     "workers": [{"id": "decode-0", "role": "aggregated", "in_flight": 1, "where": "in-process",
                  "routed": 40}],
     (an upstream's row: "where": "vllm at http://10.0.0.5:8000"; a worker that reports its
      load, as it last did: "load": {"prefill_tokens": 900, "decoding": 3, "waiting": 1})
     "tracing": {"recording": true, "exporting": "http://collector:4318/v1/traces"},
     "planner": null, or the planner's last status (``serve --nats`` with a planner):
         {"interval_s": 10, "age_s": 3.2, "pools": [{"model", "role", "targets":
          {"ttft_p90_ms", "itl_p90_ms"}, "workers", "serving", "observed": {...},
          "changes": [{"at", "from", "to", "reason"}, ...], ...}]}
     "recent": [ ... RecentRequest.as_dict() ... ]}

Tokens per second is the page's to compute: the difference of ``output_tokens_total``
between two polls over their time apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, final

from operators.edges.http.request_span import REQUEST_OWNER
from pipeline import WorkerLoad, WorkerSet

if TYPE_CHECKING:
    from operators.edges.openai.server import OpenAIApp
    from operators.telemetry import SpanBuffer

__all__ = ("StatusReport", "WorkerGroups", "worker_rows")

WorkerGroups: TypeAlias = Mapping[str, "WorkerSet[Any, Any] | None"]
"""The worker sets a server routes to, by role (``aggregated``, ``decode``, ``prefill``,
``encode``); None for a role it has none of."""


def worker_rows(groups: WorkerGroups, where: str) -> list[dict[str, Any]]:
    """One row per member of ``groups``: id, role, requests in flight, requests routed to
    it, ``where`` it runs (an engine that says where it is, an upstream server, says it
    instead: its ``where``), and the load it last reported (``load``), when it reports
    one."""
    rows: list[dict[str, Any]] = []
    for role, workers in groups.items():
        if workers is None:
            continue
        for w in workers.members:
            own = getattr(w.engine, "where", None)
            row = {
                "id": w.id,
                "role": role,
                "in_flight": w.in_flight,
                "where": own if isinstance(own, str) else where,
            }
            load = getattr(w.engine, "load_report", None)
            report = load() if callable(load) else None
            if isinstance(report, WorkerLoad):
                row["load"] = {
                    "prefill_tokens": report.prefill_tokens,
                    "decoding": report.decoding,
                    "waiting": report.waiting,
                }
            row["routed"] = w.ledger.sent_total
            rows.append(row)
    return rows


def _waiting(groups: WorkerGroups) -> int:
    return sum(w.statistics().waiting for w in groups.values() if w is not None)


@final
class StatusReport:
    """Builds the status document of ``app``.

    ``workers`` names the worker sets by role (read at each call, so discovered workers
    come and go); without any, the server's one engine is shown as ``engine`` (named
    ``engine_name``). ``buffer`` holds the last requests' spans (None: no stage timings).
    ``exporting`` names the OTLP endpoint, if any. ``planner`` gives the planner's last
    status, if one spoke lately.
    """

    __slots__ = (
        "_app",
        "_buffer",
        "_engine_name",
        "_exporting",
        "_planner",
        "_started",
        "_where",
        "_workers",
    )

    def __init__(
        self,
        app: OpenAIApp,
        *,
        workers: Callable[[], WorkerGroups] | None = None,
        where: str = "in-process",
        engine_name: str = "engine",
        buffer: SpanBuffer | None = None,
        exporting: str | None = None,
        planner: Callable[[], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self._app = app
        self._planner = planner
        self._workers = workers
        self._where = where
        self._engine_name = engine_name
        self._buffer = buffer
        self._exporting = exporting
        self._started = time.monotonic()

    def __call__(self, owner: str | None = None) -> dict[str, Any]:
        """The status document, now; its recent requests only ``owner``'s (None: all)."""
        app = self._app
        totals, requests = _totals(app)
        sample = totals.get
        groups = self._workers() if self._workers is not None else {}
        rows = worker_rows(groups, self._where)
        if not rows and self._workers is None:
            rows = [
                {
                    "id": self._engine_name,
                    "role": "aggregated",
                    "in_flight": app.inflight,
                    "where": "in-process",
                }
            ]
        waiting = _waiting(groups) + int(sample("llm_pipeline_llama_waiting_sequences") or 0)
        buffer = self._buffer
        return {
            "model": app.model_name,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "draining": app.draining,
            "in_flight": app.inflight,
            "waiting": waiting,
            "requests_total": int(requests),
            "output_tokens_total": int(sample("llm_pipeline_output_tokens_total") or 0),
            "kv": _kv(sample),
            "workers": rows,
            "tracing": {"recording": buffer is not None, "exporting": self._exporting},
            "planner": None if self._planner is None else self._planner(),
            "recent": [] if buffer is None else _recent(buffer, owner),
        }


def _recent(buffer: SpanBuffer, owner: str | None) -> list[dict[str, Any]]:
    """The last requests (all, or those ``owner`` made: a key sees only its own)."""
    return [
        request.as_dict()
        for request in buffer.recent()
        if owner is None or request.root.attributes.get(REQUEST_OWNER) == owner
    ]


def _totals(app: OpenAIApp) -> tuple[dict[str, float], float]:
    """Every sample of the app's metrics summed over its labels, by sample name; and the
    generation requests finished."""
    totals: dict[str, float] = {}
    requests = 0.0
    for metric in app.metrics.registry.collect():
        for sample in metric.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            endpoint = sample.labels.get("endpoint", "")
            if (
                sample.name == "llm_pipeline_requests_total"
                and endpoint.startswith("/v1/")
                and endpoint != "/v1/models"
            ):
                requests += sample.value
    return totals, requests


def _kv(sample: Callable[[str], float | None]) -> dict[str, Any]:
    """The KV hit rate: the router's (blocks routed to a worker holding them), else the
    engine's own prefix cache (prompt tokens found cached), else unknown."""
    hit = sample("llm_pipeline_kv_hit_blocks_total") or 0.0
    miss = sample("llm_pipeline_kv_miss_blocks_total") or 0.0
    if hit + miss:
        return {
            "hit_blocks": int(hit),
            "miss_blocks": int(miss),
            "hit_rate": round(hit / (hit + miss), 4),
            "source": "router",
        }
    cached = (sample("llm_pipeline_llama_cached_prompt_tokens_total") or 0.0) + (
        sample("llm_pipeline_cached_prompt_tokens_total") or 0.0
    )
    computed = (sample("llm_pipeline_llama_prefill_tokens_total") or 0.0) + (
        sample("llm_pipeline_prefill_tokens_total") or 0.0
    )
    if cached + computed:
        return {
            "cached_tokens": int(cached),
            "prefilled_tokens": int(computed),
            "hit_rate": round(cached / (cached + computed), 4),
            "source": "engine",
        }
    return {"hit_rate": None, "source": None}
