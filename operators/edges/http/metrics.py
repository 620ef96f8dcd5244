"""Prometheus metrics of the OpenAI HTTP server, in a registry of its own.

Each :class:`ServerMetrics` owns a ``CollectorRegistry`` (never the process-global one), so
two apps in one process, or a test that builds many, never collide. The per-request series
use ``prometheus_client`` directly. The per-token series (inter-token latency) would pay a
lock and a bucket scan per observation there, so the histograms here are plain lists
updated from the event loop's single thread and exposed by a collector at scrape time:
an observation is one ``bisect`` and two additions.

The per-request series carry a ``model`` label: the served model the request was routed to
(an adapter's own name), or "" for a request that named none it serves (an unknown name is
never a label value: clients could grow the registry). :meth:`ServerMetrics.for_model`
gives one model's children, looked up once per request.

These are the series of the requests, counted where they pass (the edge, the graph's
Migration and router hooks). What an engine does with them (its batch, KV cache, drafts,
prefills) only the engine knows, and the edge knows no engine: those collectors live in
:mod:`operators.telemetry.engine_metrics`, registered in the same
:attr:`ServerMetrics.registry` by whoever loaded the engine.

Series::

    llm_pipeline_requests_total{endpoint, status, model}  counter, one per finished request
    llm_pipeline_inflight_requests                   gauge, generation requests in progress
    llm_pipeline_waiting_requests                    gauge, generation requests waiting for a slot
    llm_pipeline_key_requests_total{key, model, status}  counter, requests per API key name
    llm_pipeline_key_tokens_total{key, model, kind}  counter, prompt/cached/output tokens per key
    llm_pipeline_output_tokens_total{model}          counter, completion tokens generated
    llm_pipeline_time_to_first_token_seconds{model}  histogram, request start -> first token
    llm_pipeline_inter_token_latency_seconds{model}  histogram, gap between token writes
    llm_pipeline_request_duration_seconds{model}     histogram, request start -> end
    llm_pipeline_migrations_total{kind, outcome}     counter, one per lost worker
    llm_pipeline_rejected_requests_total{reason}     counter, refused before the graph
    llm_pipeline_timed_out_requests_total            counter, killed at their deadline
    llm_pipeline_kv_hit_blocks_total                 counter, prompt blocks routed to a holder
    llm_pipeline_kv_miss_blocks_total                counter, prompt blocks its worker lacked
    llm_pipeline_router_decisions_total{worker}      counter, KV routing decisions per worker
    llm_pipeline_router_hit_blocks_total{worker}     counter, prompt blocks routed to it, held
    llm_pipeline_python_allocated_blocks             gauge, Python's allocated memory blocks

and the ``process_*`` series (resident memory, CPU, open files). Resident memory cannot
show a small leak: memory freed inside the process stays resident and absorbs one for a
long time. The allocated blocks, read at scrape time, can: a request that leaves one object
behind adds a block per request.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Final, final

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

__all__ = (
    "CONTENT_TYPE",
    "Histogram",
    "HistogramFamily",
    "ModelMetrics",
    "ServerMetrics",
)

#: the Content-Type of :meth:`ServerMetrics.render`'s output
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Finer where latency targets are usually set (a planner reads its p90 from these buckets:
# within one, it can only interpolate): about 1.33x apart from 50 ms to 1 s for the TTFT,
# from 10 ms to 200 ms for the inter-token latency.
_TTFT_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
    0.4, 0.5, 0.6, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_ITL_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025,
    0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 5.0,
)  # fmt: skip
_DURATION_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


@final
class Histogram:
    """A lock-free histogram for the event loop's thread; exposed via :class:`ServerMetrics`.

    Not thread-safe on purpose: every observation comes from the one thread running the
    event loop, and a scrape runs on that thread too.
    """

    __slots__ = ("_bounds", "_counts", "_sum", "documentation", "name")

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(sorted(buckets))
        # one count per bound, plus one for +Inf
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Record one observation (``le`` is inclusive, as in Prometheus)."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    @property
    def count(self) -> int:
        """How many observations so far."""
        return sum(self._counts)

    @property
    def bounds(self) -> tuple[float, ...]:
        """The buckets' upper bounds (the last bucket, +Inf, is not among them)."""
        return self._bounds

    @property
    def counts(self) -> tuple[int, ...]:
        """Observations per bucket, not cumulative: one per bound, then the +Inf bucket's."""
        return tuple(self._counts)

    @property
    def sum(self) -> float:
        """The sum of all observations so far."""
        return self._sum

    def family(self) -> HistogramMetricFamily:
        """The histogram as a Prometheus metric family (cumulative buckets)."""
        return HistogramMetricFamily(
            self.name, self.documentation, buckets=self.buckets(), sum_value=self._sum
        )

    def buckets(self) -> list[tuple[str, float]]:
        """The cumulative buckets, as Prometheus exposes them."""
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            total += count
            buckets.append((repr(bound), total))
        buckets.append(("+Inf", total + self._counts[-1]))
        return buckets


@final
class HistogramFamily:
    """Lock-free :class:`Histogram` s by the value of one label (``model``), exposed as one
    Prometheus family; the event loop's thread only, like :class:`Histogram`."""

    __slots__ = ("_buckets", "_children", "documentation", "label", "name")

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], label: str) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self._buckets = tuple(buckets)
        self._children: dict[str, Histogram] = {}

    def labels(self, value: str) -> Histogram:
        """The histogram of the label's ``value`` (made on first use)."""
        child = self._children.get(value)
        if child is None:
            child = self._children[value] = Histogram(self.name, self.documentation, self._buckets)
        return child

    def children(self) -> dict[str, Histogram]:
        """Each label value's histogram (a new dict; the histograms are the live ones)."""
        return dict(self._children)

    @property
    def count(self) -> int:
        """Observations so far, every label value together."""
        return sum(child.count for child in self._children.values())

    @property
    def sum(self) -> float:
        """The sum of every observation so far."""
        return sum(child.sum for child in self._children.values())

    def family(self) -> HistogramMetricFamily:
        """Every child as one Prometheus metric family."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, child in sorted(self._children.items()):
            family.add_metric([value], child.buckets(), child.sum)
        return family


class _HistogramCollector(Collector):
    def __init__(self, histograms: Sequence[HistogramFamily]) -> None:
        self._histograms = tuple(histograms)

    def collect(self) -> Iterator[Metric]:
        for histogram in self._histograms:
            yield histogram.family()

    def describe(self) -> Iterator[Metric]:
        for histogram in self._histograms:
            yield HistogramMetricFamily(
                histogram.name, histogram.documentation, labels=[histogram.label]
            )


@final
class ModelMetrics:
    """One model's per-request series (children of :class:`ServerMetrics`' families)."""

    __slots__ = (
        "_model",
        "_output_tokens",
        "_tokens",
        "inter_token_latency",
        "request_duration",
        "time_to_first_token",
    )

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self.time_to_first_token = metrics.time_to_first_token.labels(model)
        self.inter_token_latency = metrics.inter_token_latency.labels(model)
        self.request_duration = metrics.request_duration.labels(model)
        self._tokens = metrics.output_tokens
        self._model = model
        self._output_tokens: Counter | None = None

    @property
    def output_tokens(self) -> Counter:
        """The model's ``llm_pipeline_output_tokens_total`` (shown from its first token)."""
        counter = self._output_tokens
        if counter is None:
            counter = self._output_tokens = self._tokens.labels(self._model)
        return counter


@final
class _KeyCounters:
    """One key's series for one model and status, looked up once."""

    __slots__ = ("cached", "output", "prompt", "requests")

    def __init__(self, metrics: ServerMetrics, key: str, model: str, status: int) -> None:
        self.requests = metrics.key_requests.labels(key, model, str(status))
        self.prompt = metrics.key_tokens.labels(key, model, "prompt")
        self.cached = metrics.key_tokens.labels(key, model, "cached")
        self.output = metrics.key_tokens.labels(key, model, "output")


@final
class ServerMetrics:
    """The server's metrics, registered in ``registry`` (a fresh one when not given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "llm_pipeline_requests",
            "Finished HTTP requests by endpoint, status code (499: the client went away) and "
            "model ('' for requests of no served model).",
            ["endpoint", "status", "model"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "llm_pipeline_inflight_requests",
            "Generation requests being served now.",
            registry=self.registry,
        )
        self.waiting = Gauge(
            "llm_pipeline_waiting_requests",
            "Generation requests waiting for a slot of --max-inflight (fair-queued by key).",
            registry=self.registry,
        )
        self.key_requests = Counter(
            "llm_pipeline_key_requests",
            "Finished requests by API key name (never the key; '' without keys), model and "
            "status code (429: over one of the key's limits).",
            ["key", "model", "status"],
            registry=self.registry,
        )
        self.key_tokens = Counter(
            "llm_pipeline_key_tokens",
            "Tokens by API key name, model and kind: 'prompt', 'cached' (of the prompt, found "
            "in a prefix cache) and 'output', as the responses' usage said them.",
            ["key", "model", "kind"],
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "llm_pipeline_output_tokens",
            "Completion tokens of finished responses (from their usage), by model.",
            ["model"],
            registry=self.registry,
        )
        self.time_to_first_token = HistogramFamily(
            "llm_pipeline_time_to_first_token_seconds",
            "From the request's arrival to the write of its first token, by model.",
            _TTFT_BUCKETS,
            "model",
        )
        self.inter_token_latency = HistogramFamily(
            "llm_pipeline_inter_token_latency_seconds",
            "Gap between consecutive token writes of one streamed response, by model.",
            _ITL_BUCKETS,
            "model",
        )
        self.request_duration = HistogramFamily(
            "llm_pipeline_request_duration_seconds",
            "From a generation request's arrival to the end of its response, by model.",
            _DURATION_BUCKETS,
            "model",
        )
        self.registry.register(
            _HistogramCollector(
                (self.time_to_first_token, self.inter_token_latency, self.request_duration)
            )
        )
        self.migrations = Counter(
            "llm_pipeline_migrations",
            "Workers lost under a request: kind 'connect' (before any output) or 'stream' "
            "(mid-stream); outcome 'retried' (moved to another worker) or 'exhausted' "
            "(no retry left: the client got the error).",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "llm_pipeline_rejected_requests",
            "Requests refused before reaching the graph, by reason: 'max_inflight' (503, "
            "admission control), 'draining' (503, shutting down), 'invalid_api_key' (401), "
            "'rate_limited' (429, a key's limit), 'engine_unavailable' (503: every engine of "
            "the model stalled, failing or dead).",
            ["reason"],
            registry=self.registry,
        )
        for reason in (
            "max_inflight",
            "draining",
            "invalid_api_key",
            "rate_limited",
            "engine_unavailable",
        ):
            self.rejected.labels(reason)  # shown at 0 before the first rejection
        self.timed_out = Counter(
            "llm_pipeline_timed_out_requests",
            "Generation requests killed at their deadline (--request-timeout).",
            registry=self.registry,
        )
        self.kv_hit_blocks = Counter(
            "llm_pipeline_kv_hit_blocks",
            "Prompt blocks the KV router sent to a worker already holding them.",
            registry=self.registry,
        )
        self.kv_miss_blocks = Counter(
            "llm_pipeline_kv_miss_blocks",
            "Prompt blocks the KV router sent to a worker that must prefill them.",
            registry=self.registry,
        )
        self.router_decisions = Counter(
            "llm_pipeline_router_decisions",
            "Requests the KV router sent to each worker.",
            ["worker"],
            registry=self.registry,
        )
        self.router_hit_blocks = Counter(
            "llm_pipeline_router_hit_blocks",
            "Prompt blocks the KV router sent to each worker already holding them.",
            ["worker"],
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)
        Gauge(
            "llm_pipeline_python_allocated_blocks",
            "Memory blocks Python's object allocator has handed out and not had back "
            "(one per object, and one per dict's or list's storage): a request that leaves "
            "one object behind adds one per request, where resident memory shows nothing.",
            registry=self.registry,
        ).set_function(sys.getallocatedblocks)
        self._request_counters: dict[tuple[str, int, str], Counter] = {}
        self._decision_counters: dict[str, tuple[Counter, Counter]] = {}
        self._models: dict[str, ModelMetrics] = {}
        self._key_counters: dict[tuple[str, str, int], _KeyCounters] = {}

    def for_model(self, model: str) -> ModelMetrics:
        """The per-request series of ``model`` (a served model's name, or "")."""
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(self, model)
        return found

    def count_request(self, endpoint: str, status: int, model: str = "") -> None:
        """Count one finished request (``model``: the served model it was routed to)."""
        key = (endpoint, status, model)
        counter = self._request_counters.get(key)
        if counter is None:
            counter = self._request_counters[key] = self.requests.labels(
                endpoint, str(status), model
            )
        counter.inc()

    def count_key(
        self, key: str, model: str, status: int, prompt: int = 0, cached: int = 0, output: int = 0
    ) -> None:
        """Count one request of the API key named ``key`` on ``model``, with its tokens."""
        found = self._key_counters.get((key, model, status))
        if found is None:
            found = self._key_counters[key, model, status] = _KeyCounters(self, key, model, status)
        found.requests.inc()
        if prompt:
            found.prompt.inc(prompt)
        if cached:
            found.cached.inc(cached)
        if output:
            found.output.inc(output)

    def count_migration(self, kind: str, outcome: str) -> None:
        """Count one lost worker (the ``on_event`` hook of :class:`operators.Migration`)."""
        self.migrations.labels(kind, outcome).inc()

    def count_kv_decision(self, worker: str, hit: int, miss: int) -> None:
        """Count one KV routing decision (``KvRouter``'s ``on_decision``): it runs on the
        routing path, so the worker's counter is looked up once."""
        counters = self._decision_counters.get(worker)
        if counters is None:
            counters = self._decision_counters[worker] = (
                self.router_decisions.labels(worker),
                self.router_hit_blocks.labels(worker),
            )
        decisions, hits = counters
        decisions.inc()
        if hit:
            self.kv_hit_blocks.inc(hit)
            hits.inc(hit)
        if miss:
            self.kv_miss_blocks.inc(miss)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (see :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
