"""One model's engine and graph options as ``serve`` builds them: in-process workers, a
loaded model engine, or workers discovered over NATS (:func:`engine_and_options`).

Apart from :mod:`.serve` because every model of a server goes through it: the one model of
a plain ``serve``, each model of ``--models FILE``, and each model ``serve --nats``
discovers (:mod:`.discovered`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from operators.contracts.constraint_guard import GUARDED
from operators.contracts.llm import CONSTRAINED_DECODING, EngineOutput, PreprocessedRequest
from operators.edges.openai.images import ImagePolicy
from operators.engines.mocker import MockerStatistics
from operators.telemetry.engine_metrics import watch_prefill
from operators.telemetry.router_metrics import watch_routers
from pipeline import Engine, KvRouter, PrefixIndex, Router, WorkerSet

from .engines import worker_set
from .health import supervise
from .output_options import output_options
from .routing import remote_kv_policy, routing_policy, upstream_policy

if TYPE_CHECKING:
    from operators.contracts.transport import WorkerSets
    from operators.edges.http.metrics import ServerMetrics
    from operators.graph import GraphOptions
    from operators.text.tokenizer import Tokenizer
    from operators.ui import WorkerGroups
    from pipeline import RoutingPolicy

    from .config import ServeConfig
    from .nats import KvFeed

__all__ = ("engine_and_options",)

_Workers = WorkerSet[PreprocessedRequest, EngineOutput]
_Engine = Engine[PreprocessedRequest, EngineOutput]


def engine_and_options(
    config: ServeConfig,
    tokenizer: Tokenizer,
    workers: WorkerSets | None,
    engine: _Engine | None,
    metrics: ServerMetrics | None = None,
    kv_feeds: Sequence[KvFeed] | None = None,
    local: tuple[_Workers, _Workers | None] | None = None,
) -> tuple[_Engine, GraphOptions, WorkerGroups | None]:
    """The engine to put behind the default graph, the graph's options, and the worker
    sets by role (for the status view; None: ``engine`` was given, a single one).

    In-process decode workers are routed as ``config.router`` says (one worker under the
    default round-robin is used directly); their KV routing decisions and prefix-cache
    counts go to ``metrics``. ``local`` holds already loaded (decode, prefill) worker sets
    (llama.cpp's); without it they are made from ``config`` (echo, mocker).

    ``engine`` (an already loaded one, e.g. llama.cpp's) replaces in-process workers. With
    ``--engine remote``, ``local`` holds the upstreams' worker set (``open_remote``): a
    Router over it, waiting ``config.worker_wait`` for one to be up, retrying elsewhere.
    ``workers`` (discovered remote workers) replaces the in-process ones: the engine is then
    a round-robin Router over ``workers.decode`` whose retries avoid the workers already
    tried (:class:`~operators.contracts.transport.RetryElsewhere`) and that waits
    ``config.worker_wait`` seconds for a member. Under ``--router kv`` it routes by the
    (decode, prefill) ``kv_feeds`` instead, fed by the workers' KV events and load reports
    over NATS (unfed ones when not given), and so does the PrefillRouter.
    """
    encode: _Workers | None
    prefill: _Workers | None
    features: frozenset[str] | None = None  # what the engine declares
    prefill_policy: RoutingPolicy | None = None
    groups: WorkerGroups | None = None
    if engine is not None:
        encode = prefill = None
    elif config.engine.engine == "remote":
        if local is None:
            raise ValueError("--engine remote needs its upstreams connected (open_remote)")
        decode, encode, prefill = local[0], None, None
        engine = Router(decode, upstream_policy(config, decode, metrics), wait=config.worker_wait)
        groups = {"aggregated": decode, "prefill": None, "encode": None}
        features = frozenset({CONSTRAINED_DECODING})  # (each upstream maps or refuses them)
    elif workers is None:
        engine_config = config.engine
        decode_role = "decode" if config.prefill_workers else "aggregated"
        kv = config.router == "kv"
        encode = None
        if local is not None:
            decode, prefill = local
        else:
            made = worker_set(engine_config, tokenizer, decode_role, config.decode_workers, kv=kv)
            assert made is not None
            decode = made
            encode = worker_set(engine_config, tokenizer, "encode", config.encode_workers)
            prefill = worker_set(engine_config, tokenizer, "prefill", config.prefill_workers, kv=kv)
            for made_set in (decode, encode, prefill):
                _supervise_members(made_set, config)
        if len(decode) == 1 and config.router == "round-robin":
            engine = decode.members[0].engine
        else:
            # Loaded workers are rebuilt when they die: a request waits for one meanwhile
            # (within its deadline); the edge refuses it at once when none can come back.
            wait = math.inf if local is not None else 0.0
            engine = Router(decode, routing_policy(config, decode, metrics), wait=wait)
        if kv and prefill is not None:  # prompts are prefilled where their prefix is
            prefill_policy = routing_policy(config, prefill, metrics)
        if metrics is not None and engine_config.engine != "echo":
            watch_prefill(metrics.registry, _prefill_counts(decode, prefill))
        groups = {decode_role: decode, "prefill": prefill, "encode": encode}
    else:
        from operators.contracts.retry_elsewhere import RetryElsewhere

        policy: RoutingPolicy = RetryElsewhere()
        if config.router == "kv":
            if kv_feeds:
                decode_feed, prefill_feed = kv_feeds
                policy = remote_kv_policy(config, decode_feed.prefixes, metrics, decode_feed.report)
                prefill_policy = remote_kv_policy(
                    config, prefill_feed.prefixes, metrics, prefill_feed.report
                )
            else:  # (unfed: a graph built without NATS)
                policy = remote_kv_policy(config, PrefixIndex(), metrics)
                prefill_policy = remote_kv_policy(config, PrefixIndex(), metrics)
        engine = Router(workers.decode, policy, wait=config.worker_wait)
        encode, prefill = workers.encode, workers.prefill
        groups = {"decode": workers.decode, "prefill": prefill, "encode": encode}
        # Remote workers check constraints and reasoning budgets themselves (each behind
        # its own guard): the llama engine honours them, the echo and mocker engines refuse
        # them with a 400 that travels back by name.
        features = GUARDED
    if metrics is not None:  # the llm_pipeline_router_* series of every routed set
        _watch(config, metrics, engine, prefill, prefill_policy)
    options: GraphOptions = {
        **output_options(config),
        "max_model_len": config.max_model_len,
        "default_max_tokens": config.default_max_tokens,
        "migration_limit": config.migration_limit,
        "encode_workers": encode,
        "prefill_workers": prefill,
        "prefill_policy": prefill_policy,
        "disagg_min_prompt_tokens": config.disagg_min_prompt_tokens,
        "images": ImagePolicy(
            allowed_hosts=config.allowed_image_hosts, max_bytes=config.max_image_bytes
        ),
        "engine_features": features,
    }
    return engine, options, groups


def _supervise_members(workers: _Workers | None, config: ServeConfig) -> None:
    """Put each of ``workers`` (echo or mocker engines: nothing to rebuild) under watch."""
    if workers is not None:
        for worker in workers.members:
            workers.add(worker.id, supervise(worker.engine, config, name=worker.id))


def _prefill_counts(*sets: _Workers | None) -> Callable[[], dict[str, tuple[int, int]]]:
    """Per worker, (prompt tokens prefilled, prompt tokens found cached), at scrape time."""
    members = [worker for workers in sets if workers is not None for worker in workers.members]

    def counts() -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        for worker in members:
            statistics = getattr(worker.engine, "statistics", None)
            stats: Any = statistics() if statistics is not None else None
            if isinstance(stats, MockerStatistics) or hasattr(stats, "prefill_tokens"):
                # the mocker's and the llama engine's statistics alike
                found[worker.id] = (stats.prefill_tokens, stats.cached_prompt_tokens)
        return found

    return counts


def _watch(
    config: ServeConfig,
    metrics: ServerMetrics,
    engine: _Engine,
    prefill: _Workers | None,
    prefill_policy: RoutingPolicy | None,
) -> None:
    """Register the routed sets (the decode Router's, the prefill one) for the router
    series, each with what its KV router (if any) weighs a worker by."""
    collector = watch_routers(metrics.registry)
    routed: list[tuple[_Workers, Any]] = []
    if isinstance(engine, Router):
        routed.append((engine.workers, engine.policy))
    if prefill is not None:
        routed.append((prefill, prefill_policy))
    model = config.model_name
    for workers, policy in routed:
        kv = getattr(policy, "policy", policy)  # (inside a RetryElsewhere)
        name = workers.name
        label = name if name.startswith(model) else f"{model} {name}".strip()
        if isinstance(kv, KvRouter):
            collector.watch(workers, kv.work, kv.report, label=label)
        else:
            collector.watch(workers, label=label)
