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

Series::

    llm_pipeline_requests_total{endpoint, status, model}  counter, one per finished request
    llm_pipeline_inflight_requests                   gauge, generation requests in progress
    llm_pipeline_output_tokens_total{model}          counter, completion tokens generated
    llm_pipeline_time_to_first_token_seconds{model}  histogram, request start -> first token
    llm_pipeline_inter_token_latency_seconds{model}  histogram, gap between token writes
    llm_pipeline_request_duration_seconds{model}     histogram, request start -> end
    llm_pipeline_migrations_total{kind, outcome}     counter, one per lost worker
    llm_pipeline_speculative_{proposed,accepted}_tokens_total   counters, draft tokens
    llm_pipeline_llama_running_sequences             gauge, sequences in a slot (llama engine)
    llm_pipeline_llama_waiting_sequences             gauge, sequences waiting for a slot
    llm_pipeline_llama_batch_size                    histogram, sequences per engine step
    llm_pipeline_llama_prefill_tokens_total          counter, prompt tokens evaluated
    llm_pipeline_llama_cached_prompt_tokens_total    counter, prompt tokens found in the cache
    llm_pipeline_llama_decode_tokens_total           counter, tokens fed to decode (+ drafts)
    llm_pipeline_kv_tier_hits_total{tier}            counter, KV blocks restored from a tier
    llm_pipeline_kv_restored_tokens_total{tier}      counter, prompt tokens restored from a tier
    llm_pipeline_kv_saved_blocks_total{tier}         counter, KV blocks saved to the first tier
    llm_pipeline_kv_transferred_tokens_total         counter, prompt tokens pulled (decode)
    llm_pipeline_kv_transferred_bytes_total          counter, their bytes
    llm_pipeline_kv_transfer_recomputed_total        counter, handles prefilled again instead
    llm_pipeline_kv_transfer_seconds_total           counter, time spent pulling KV (decode)
    llm_pipeline_vllm_running_requests               gauge, requests vLLM runs (vllm engine)
    llm_pipeline_vllm_waiting_requests               gauge, requests waiting in vLLM's queue
    llm_pipeline_vllm_kv_cache_usage_ratio           gauge, fraction of vLLM's KV blocks in use
    llm_pipeline_vllm_prefix_cache_{queries,hits}_total  counters, prompt tokens looked up/found
    llm_pipeline_vllm_preemptions_total              counter, requests preempted for KV room
    llm_pipeline_kv_hit_blocks_total                 counter, prompt blocks routed to a holder
    llm_pipeline_kv_miss_blocks_total                counter, prompt blocks its worker lacked
    llm_pipeline_router_decisions_total{worker}      counter, KV routing decisions per worker
    llm_pipeline_prefill_tokens_total{worker}        counter, prompt tokens prefilled (mocker)
    llm_pipeline_cached_prompt_tokens_total{worker}  counter, prompt tokens found cached (mocker)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, NamedTuple, final

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

__all__ = (
    "CONTENT_TYPE",
    "BatchingCounts",
    "EngineLoad",
    "Histogram",
    "HistogramFamily",
    "KvCounts",
    "ModelMetrics",
    "ServerMetrics",
)

#: the Content-Type of :meth:`ServerMetrics.render`'s output
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_ITL_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
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


class _SpeculationCollector(Collector):
    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        proposed, accepted = self._counts()
        yield CounterMetricFamily(
            "llm_pipeline_speculative_proposed_tokens",
            "Draft tokens proposed by speculative decoding.",
            value=proposed,
        )
        yield CounterMetricFamily(
            "llm_pipeline_speculative_accepted_tokens",
            "Draft tokens that matched the model's own choice and were kept.",
            value=accepted,
        )


class BatchingCounts(NamedTuple):
    """What :meth:`ServerMetrics.watch_batching` reads from a batching engine at scrape time."""

    #: sequences decoding or prefilling now
    running: int
    #: sequences waiting for a slot now
    waiting: int
    #: steps by batch size: ``batch_sizes[k]`` steps held k sequences
    batch_sizes: Sequence[int]
    #: prompt tokens evaluated so far
    prefill_tokens: int
    #: prompt tokens found in the cache so far
    cached_prompt_tokens: int
    #: tokens fed to decode steps so far (one per sequence and step, plus drafts)
    decode_tokens: int


class _BatchingCollector(Collector):
    def __init__(self, counts: Callable[[], BatchingCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        yield GaugeMetricFamily(
            "llm_pipeline_llama_running_sequences",
            "Sequences in one of the llama engine's slots (decoding or prefilling).",
            value=counts.running,
        )
        yield GaugeMetricFamily(
            "llm_pipeline_llama_waiting_sequences",
            "Sequences waiting for a slot of the llama engine.",
            value=counts.waiting,
        )
        yield _batch_size_family(counts.batch_sizes)
        yield CounterMetricFamily(
            "llm_pipeline_llama_prefill_tokens",
            "Prompt tokens the llama engine evaluated (not found in its cache).",
            value=counts.prefill_tokens,
        )
        yield CounterMetricFamily(
            "llm_pipeline_llama_cached_prompt_tokens",
            "Prompt tokens the llama engine found in its cache (prefix reuse, n > 1).",
            value=counts.cached_prompt_tokens,
        )
        yield CounterMetricFamily(
            "llm_pipeline_llama_decode_tokens",
            "Tokens the llama engine fed to decode: one per sequence and step, plus drafts.",
            value=counts.decode_tokens,
        )


class KvCounts(NamedTuple):
    """What :meth:`ServerMetrics.watch_kv` reads from engines that move KV, at scrape time."""

    #: KV blocks restored from each tier ("host", "disk")
    tier_hits: Mapping[str, int]
    #: prompt tokens those blocks held (not already in the slot), by tier
    restored_tokens: Mapping[str, int]
    #: KV blocks saved to the first tier before their slot was overwritten
    saved_blocks: Mapping[str, int]
    #: prompt tokens (cells) a decode worker pulled from prefill workers, and their bytes
    transferred_tokens: int
    transferred_bytes: int
    #: transfer handles whose KV could not be pulled (the decode worker prefilled)
    transfer_recomputed: int
    #: seconds decode workers spent pulling KV
    transfer_seconds: float = 0.0


#: the tiers shown (at 0) before their first count
_TIERS: Final = ("host", "disk")


class _KvCollector(Collector):
    def __init__(self, counts: Callable[[], KvCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        for name, documentation, values in (
            (
                "llm_pipeline_kv_tier_hits",
                "KV blocks restored into a slot from a tier below it, by tier.",
                counts.tier_hits,
            ),
            (
                "llm_pipeline_kv_restored_tokens",
                "Prompt tokens restored from a KV tier instead of prefilled, by tier.",
                counts.restored_tokens,
            ),
            (
                "llm_pipeline_kv_saved_blocks",
                "KV blocks saved to the first tier before their slot was overwritten.",
                counts.saved_blocks,
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=["tier"])
            for tier in sorted({*_TIERS, *values}):
                family.add_metric([tier], values.get(tier, 0))
            yield family
        yield CounterMetricFamily(
            "llm_pipeline_kv_transferred_tokens",
            "Prompt tokens whose KV a decode worker pulled from a prefill worker.",
            value=counts.transferred_tokens,
        )
        yield CounterMetricFamily(
            "llm_pipeline_kv_transferred_bytes",
            "Bytes of KV a decode worker pulled from prefill workers.",
            value=counts.transferred_bytes,
        )
        yield CounterMetricFamily(
            "llm_pipeline_kv_transfer_recomputed",
            "Transfer handles whose KV could not be pulled: the decode worker prefilled.",
            value=counts.transfer_recomputed,
        )
        yield CounterMetricFamily(
            "llm_pipeline_kv_transfer_seconds",
            "Seconds decode workers spent pulling KV from prefill workers.",
            value=counts.transfer_seconds,
        )


def _batch_size_family(batch_sizes: Sequence[int]) -> HistogramMetricFamily:
    """Steps by batch size as a histogram with power-of-two bounds up to the largest size."""
    largest = len(batch_sizes) - 1
    bounds = [1 << i for i in range(largest.bit_length()) if 1 << i < largest] + [largest]
    buckets: list[tuple[str, float]] = []
    total = 0
    size = 0
    for bound in bounds if largest > 0 else []:
        while size <= bound:
            total += batch_sizes[size]
            size += 1
        buckets.append((repr(float(bound)), total))
    buckets.append(("+Inf", sum(batch_sizes)))
    return HistogramMetricFamily(
        "llm_pipeline_llama_batch_size",
        "Sequences in one step of the llama engine (one llama_decode).",
        buckets=buckets,
        sum_value=sum(size * steps for size, steps in enumerate(batch_sizes)),
    )


class EngineLoad(NamedTuple):
    """What :meth:`ServerMetrics.watch_engine` reads at scrape time from an engine that
    schedules its own batch (vLLM reports it once per step)."""

    #: requests (choices) running now
    running: int
    #: requests (choices) waiting for room in the batch or the KV cache
    waiting: int
    #: fraction of KV cache blocks in use (0..1)
    kv_cache_usage: float
    #: prompt tokens looked up in the prefix cache so far, and found there
    prefix_cache_queries: int
    prefix_cache_hits: int
    #: requests preempted so far (their KV dropped for room, recomputed later)
    preemptions: int


class _EngineLoadCollector(Collector):
    def __init__(self, engine: str, load: Callable[[], EngineLoad]) -> None:
        self._engine = engine
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load, name = self._load(), f"llm_pipeline_{self._engine}"
        yield GaugeMetricFamily(
            f"{name}_running_requests", "Requests the engine is running.", value=load.running
        )
        yield GaugeMetricFamily(
            f"{name}_waiting_requests",
            "Requests waiting for room in the engine's batch or KV cache.",
            value=load.waiting,
        )
        yield GaugeMetricFamily(
            f"{name}_kv_cache_usage_ratio",
            "Fraction of the engine's KV cache blocks in use.",
            value=load.kv_cache_usage,
        )
        yield CounterMetricFamily(
            f"{name}_prefix_cache_queries",
            "Prompt tokens the engine looked up in its prefix cache.",
            value=load.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            f"{name}_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache.",
            value=load.prefix_cache_hits,
        )
        yield CounterMetricFamily(
            f"{name}_preemptions",
            "Requests the engine preempted (KV dropped for room, recomputed later).",
            value=load.preemptions,
        )


class _PrefillCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        computed = CounterMetricFamily(
            "llm_pipeline_prefill_tokens",
            "Prompt tokens a worker prefilled (not found in its prefix cache).",
            labels=["worker"],
        )
        cached = CounterMetricFamily(
            "llm_pipeline_cached_prompt_tokens",
            "Prompt tokens a worker found in its prefix cache (their prefill was skipped).",
            labels=["worker"],
        )
        for worker, (prefilled, found) in sorted(self._counts().items()):
            computed.add_metric([worker], prefilled)
            cached.add_metric([worker], found)
        yield computed
        yield cached


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
            "admission control), 'draining' (503, shutting down), 'invalid_api_key' (401).",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("max_inflight", "draining", "invalid_api_key"):
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
        ProcessCollector(registry=self.registry)
        self._request_counters: dict[tuple[str, int, str], Counter] = {}
        self._decision_counters: dict[str, Counter] = {}
        self._models: dict[str, ModelMetrics] = {}

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

    def count_migration(self, kind: str, outcome: str) -> None:
        """Count one lost worker (the ``on_event`` hook of :class:`operators.Migration`)."""
        self.migrations.labels(kind, outcome).inc()

    def count_kv_decision(self, worker: str, hit: int, miss: int) -> None:
        """Count one KV routing decision (``KvRouter``'s ``on_decision``): it runs on the
        routing path, so the worker's counter is looked up once."""
        counter = self._decision_counters.get(worker)
        if counter is None:
            counter = self._decision_counters[worker] = self.router_decisions.labels(worker)
        counter.inc()
        if hit:
            self.kv_hit_blocks.inc(hit)
        if miss:
            self.kv_miss_blocks.inc(miss)

    def watch_prefill(self, counts: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        """Expose workers' prefill counts, read at scrape time: ``counts()`` maps a worker
        id to (prompt tokens prefilled, prompt tokens found in its prefix cache)."""
        self.registry.register(_PrefillCollector(counts))

    def watch_speculation(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Expose an engine's speculative-decoding counts, read at scrape time.

        ``counts()`` returns (draft tokens proposed, draft tokens accepted) so far.
        """
        self.registry.register(_SpeculationCollector(counts))

    def watch_batching(self, counts: Callable[[], BatchingCounts]) -> None:
        """Expose a batching engine's load and step counts, read at scrape time."""
        self.registry.register(_BatchingCollector(counts))

    def watch_kv(self, counts: Callable[[], KvCounts]) -> None:
        """Expose engines' KV tier and transfer counts, read at scrape time."""
        self.registry.register(_KvCollector(counts))

    def watch_engine(self, engine: str, load: Callable[[], EngineLoad]) -> None:
        """Expose an engine's own scheduler load as ``llm_pipeline_{engine}_*``, read at
        scrape time."""
        self.registry.register(_EngineLoadCollector(engine, load))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (see :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
