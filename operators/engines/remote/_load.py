"""An upstream's load, as the server itself reports it, for the router and the metrics.

Read every ``--upstream-poll-ms`` (:meth:`RemoteEngine.poll`): vLLM's ``/metrics``
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, summed over its engines), llama-server's ``/slots`` (the
slots processing) and, with ``--metrics``, its ``llamacpp:requests_deferred`` (waiting).
The server's numbers count every client's requests, not only ours: that is the point of
reading them.

A report is old the moment it is read: requests sent after it are not in it. So
:class:`UpstreamLoad` carries ``sent_since``, the requests this engine sent the server since
the report was read, and :func:`reported_load` (what the routers weigh, in requests) is the
report plus those: a burst between two reports does not all go to the server that looked
idle at the last one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple

from pipeline import Worker

__all__ = ("UpstreamLoad", "llama_load", "reported_load", "vllm_load")

_VLLM: Final = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}


class UpstreamLoad(NamedTuple):
    """An upstream's load as it last reported it."""

    #: requests (sequences) it runs now
    running: int
    #: requests waiting for room in its batch or KV cache
    waiting: int
    #: the fraction of its KV cache in use (None: not reported)
    kv_cache_usage: float | None
    #: when it was read (``anyio.current_time()``)
    at: float
    #: requests this engine sent it since (filled in by :meth:`RemoteEngine.load_report`)
    sent_since: int = 0


def vllm_load(text: str, at: float) -> UpstreamLoad:
    """vLLM's ``/metrics`` (Prometheus text) as a load report read at ``at``."""
    values = _samples(text.splitlines(), _VLLM)
    return UpstreamLoad(
        running=int(values.get("running", 0)),
        waiting=int(values.get("waiting", 0)),
        kv_cache_usage=values.get("kv_cache_usage"),
        at=at,
    )


def llama_load(slots: Any, metrics: str | None, at: float) -> UpstreamLoad:
    """llama-server's ``/slots`` (and ``/metrics``, when served) as a load report."""
    if not isinstance(slots, list):
        raise ValueError(f"/slots is not a list of slots: {str(slots)[:80]}")
    running = sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))
    waiting = 0
    if metrics is not None:
        waiting = int(
            _samples(metrics.splitlines(), {"llamacpp:requests_deferred": "w"}).get("w", 0)
        )
    return UpstreamLoad(running=running, waiting=waiting, kv_cache_usage=None, at=at)


def _samples(lines: Iterable[str], wanted: Mapping[str, str]) -> dict[str, float]:
    """The ``wanted`` series' values (summed over their labels), by their short names."""
    found: dict[str, float] = {}
    for line in lines:
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, rest = line.partition(" ")
        short = wanted.get(name.strip())
        if short is None:
            continue
        try:
            value = float(rest.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        found[short] = found.get(short, 0.0) + value
    return found


def reported_load(worker: Worker[Any, Any]) -> float:
    """A worker's load in requests, for a router: its server's report plus what was sent
    it since, or the requests this router has in flight there when the engine reports
    nothing (or reports less than that: the report is older than those requests)."""
    load = getattr(worker.engine, "load_report", None)
    report: UpstreamLoad | None = load() if callable(load) else None
    if report is None:
        return worker.in_flight
    return max(worker.in_flight, report.running + report.waiting + report.sent_since)
