"""An upstream's load, as the server itself reports it, for the router and the metrics.

Read every ``--upstream-poll-ms`` (:meth:`RemoteEngine.poll`): vLLM's ``/metrics``
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, summed over its engines; another of our servers says
``llm_pipeline_inflight_requests``), llama-server's ``/slots`` (the
slots processing, those past their first token) and, with ``--metrics``, its
``llamacpp:requests_deferred`` (waiting). The server's numbers count every client's
requests, not only ours: that is the point of reading them.

:class:`UpstreamLoad` is what the server said, as it said it (the metrics and the status
page show it); :meth:`UpstreamLoad.worker_load` is the same in the router's unit
(:class:`pipeline.WorkerLoad`: prompt tokens of prefill queued, sequences). Neither server
says how many prompt tokens it has queued, so they are estimated: the requests not
decoding yet, times what a request of ours has prefilled there lately (the engine's
running mean). The router adds its own requests (its ledger) to what the report counts
besides them, so the estimate only weighs other clients' work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple

from pipeline import WorkerLoad

__all__ = ("UpstreamLoad", "llama_load", "vllm_load")

_VLLM: Final = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    # another of our servers (it speaks vLLM's route, not its metrics): what it serves now
    "llm_pipeline_inflight_requests": "running",
}


class UpstreamLoad(NamedTuple):
    """An upstream's load as it last reported it."""

    #: requests (sequences) it runs now
    running: int
    #: requests waiting for room in its batch or KV cache
    waiting: int
    #: the fraction of its KV cache in use (None: not reported)
    kv_cache_usage: float | None
    #: when its answer came (``anyio.current_time()``)
    at: float
    #: of the running ones, those still before their first token (None: not said)
    prefilling: int | None = None

    def worker_load(self, prefill_per_request: float) -> WorkerLoad:
        """This report in the router's unit, the requests not decoding yet estimated at
        ``prefill_per_request`` prompt tokens each."""
        starting = self.waiting + (self.prefilling or 0)
        return WorkerLoad(
            prefill_tokens=round(starting * prefill_per_request),
            decoding=self.running - (self.prefilling or 0),
            waiting=starting,
            kv_usage=self.kv_cache_usage,
            at=self.at,
        )


def vllm_load(text: str, at: float) -> UpstreamLoad:
    """vLLM's ``/metrics`` (Prometheus text) as a load report asked at ``at``."""
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
    processing = [s for s in slots if isinstance(s, dict) and s.get("is_processing")]
    prefilling = sum(1 for slot in processing if _decoded(slot) == 0)
    waiting = 0
    if metrics is not None:
        waiting = int(
            _samples(metrics.splitlines(), {"llamacpp:requests_deferred": "w"}).get("w", 0)
        )
    return UpstreamLoad(len(processing), waiting, None, at, prefilling)


def _decoded(slot: Mapping[str, Any]) -> int | None:
    """Tokens a slot generated so far (``next_token.n_decoded``; None: not said)."""
    following = slot.get("next_token")
    if isinstance(following, list):  # (one entry per sequence in newer builds)
        following = following[0] if following else None
    decoded = following.get("n_decoded") if isinstance(following, dict) else None
    return decoded if isinstance(decoded, int) else None


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
