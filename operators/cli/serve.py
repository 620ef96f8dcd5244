"""``llm-pipeline serve``: the default graph over in-process or discovered workers, served
over HTTP until SIGINT/SIGTERM.

The graph and the app are built by :func:`operators.serving.build_app` (and so by
:func:`operators.graph.default_graph`), exactly as a user serving from Python builds
them; this module only chooses the engine and worker sets the config asks for.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from operators.contracts.llm import CONSTRAINED_DECODING, EngineOutput, PreprocessedRequest
from operators.edges.http.guard import Guard
from operators.edges.http.metrics import ServerMetrics
from operators.edges.openai.images import ImagePolicy
from operators.edges.responses import MemoryResponseStore
from operators.engines.mocker import MockerStatistics
from operators.graph import default_graph
from operators.serving import build_app, serve
from operators.telemetry import SpanBuffer, make_tracer, tracing_options
from operators.ui import WorkerGroups, attach_ui
from pipeline import Engine, PrefixIndex, Router, WorkerSet

from .config import ServeConfig
from .defaults import MODEL_ENGINES
from .engines import load_engine, load_llama_workers, watch_engine, watch_llama, worker_set
from .insertions import load_insertions
from .nats import close_nats, connect_nats, follow_kv_events, one_line
from .observability import SERVICE_NAME
from .output_options import output_options
from .routing import remote_kv_policy, routing_policy

if TYPE_CHECKING:
    from operators.contracts.llm import Embedder
    from operators.contracts.transport import WorkerSets
    from operators.edges.openai.events import OpenAIEvent
    from operators.edges.openai.preprocessor import OpenAIRequest
    from operators.edges.responses import ResponseStore
    from operators.graph import GraphOptions
    from operators.text.tokenizer import Tokenizer
    from pipeline import RoutingPolicy

__all__ = ("build_graph", "guard", "run_serve")

_Workers = WorkerSet[PreprocessedRequest, EngineOutput]
_Engine = Engine[PreprocessedRequest, EngineOutput]


def _engine_and_options(
    config: ServeConfig,
    tokenizer: Tokenizer,
    workers: WorkerSets | None,
    engine: _Engine | None,
    metrics: ServerMetrics | None = None,
    kv_indexes: Sequence[PrefixIndex] | None = None,
    local: tuple[_Workers, _Workers | None] | None = None,
) -> tuple[_Engine, GraphOptions, WorkerGroups | None]:
    """The engine to put behind the default graph, the graph's options, and the worker
    sets by role (for the status view; None: ``engine`` was given, a single one).

    In-process decode workers are routed as ``config.router`` says (one worker under the
    default round-robin is used directly); their KV routing decisions and prefix-cache
    counts go to ``metrics``. ``local`` holds already loaded (decode, prefill) worker sets
    (llama.cpp's); without it they are made from ``config`` (echo, mocker).

    ``engine`` (an already loaded one, e.g. llama.cpp's) replaces in-process workers.
    ``workers`` (discovered remote workers) replaces the in-process ones: the engine is then
    a round-robin Router over ``workers.decode`` whose retries avoid the workers already
    tried (:class:`~operators.contracts.transport.RetryElsewhere`) and that waits
    ``config.worker_wait`` seconds for a member. Under ``--router kv`` it routes by the
    (decode, prefill) ``kv_indexes`` instead, fed by the workers' KV events over NATS
    (unfed ones when not given), and so does the PrefillRouter.
    """
    encode: _Workers | None
    prefill: _Workers | None
    features: frozenset[str] | None = None  # what the engine declares
    prefill_policy: RoutingPolicy | None = None
    groups: WorkerGroups | None = None
    if engine is not None:
        encode = prefill = None
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
        if len(decode) == 1 and config.router == "round-robin":
            engine = decode.members[0].engine
        else:
            engine = Router(decode, routing_policy(config, decode, metrics))
        if kv and prefill is not None:  # prompts are prefilled where their prefix is
            prefill_policy = routing_policy(config, prefill, metrics)
        if metrics is not None and engine_config.engine != "echo":
            metrics.watch_prefill(_prefill_counts(decode, prefill))
        groups = {decode_role: decode, "prefill": prefill, "encode": encode}
    else:
        from operators.contracts.transport import RetryElsewhere

        policy: RoutingPolicy = RetryElsewhere()
        if config.router == "kv":
            decode_index, prefill_index = kv_indexes or (PrefixIndex(), PrefixIndex())
            policy = remote_kv_policy(config, decode_index, metrics)
            prefill_policy = remote_kv_policy(config, prefill_index, metrics)
        engine = Router(workers.decode, policy, wait=config.worker_wait)
        encode, prefill = workers.encode, workers.prefill
        groups = {"decode": workers.decode, "prefill": prefill, "encode": encode}
        # Remote workers check constraints themselves: the llama engine honours them, the
        # echo and mocker engines refuse them with a 400 that travels back by name.
        features = frozenset({CONSTRAINED_DECODING})
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


def build_graph(
    config: ServeConfig | argparse.Namespace,
    tokenizer: Tokenizer,
    metrics: ServerMetrics,
    workers: WorkerSets | None = None,
    *,
    engine: _Engine | None = None,
) -> Engine[OpenAIRequest, OpenAIEvent]:
    """The default graph with the engine and worker sets that ``config`` asks for.

    ``config`` may also be the parsed ``serve`` arguments. ``engine`` (an already loaded
    one, e.g. llama.cpp's) replaces in-process workers; ``workers`` (discovered remote
    workers) replaces the in-process ones with a Router that retries elsewhere. Migrations
    are counted in ``metrics``; ``--insert-before`` operators are loaded and inserted.

    Raises:
        ValueError: an operator to insert, a parser or the chat template cannot be loaded.
    """
    if isinstance(config, argparse.Namespace):
        config = ServeConfig.from_args(config)
    engine, options, _ = _engine_and_options(config, tokenizer, workers, engine, metrics)
    options["on_migration"] = metrics.count_migration
    before = load_insertions(config.insert_before)
    return default_graph(engine, tokenizer, model_name=config.model_name, before=before, **options)


def guard(config: ServeConfig) -> Guard:
    """The protections ``serve`` was asked for."""
    return Guard(
        api_keys=config.api_keys,
        max_inflight=config.max_inflight,
        request_timeout=config.request_timeout,
    )


async def _load_llama_sets(
    config: ServeConfig, stack: contextlib.AsyncExitStack
) -> tuple[_Workers, _Workers | None]:
    """The in-process llama workers ``config`` asks for: (decode or aggregated, prefill),
    each closed when ``stack`` unwinds."""
    sets: list[_Workers | None] = []
    roles = (("decode" if config.prefill_workers else "aggregated", config.decode_workers),)
    shared = config.prefill_workers + config.decode_workers > 1
    for role, count in (*roles, ("prefill", config.prefill_workers)):
        workers = await load_llama_workers(config.engine, role, count, shared=shared)
        if workers is not None:
            for worker in workers.members:
                engine: Any = worker.engine
                stack.push_async_callback(engine.aclose)
        sets.append(workers)
    decode, prefill = sets
    assert decode is not None
    return decode, prefill


def _display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def run_serve(config: ServeConfig, tokenizer: Tokenizer) -> int:
    """Serve until SIGINT/SIGTERM (then drain); the exit code (1: no NATS, no engine; 2: an
    operator to insert, a parser or the chat template cannot be loaded)."""
    try:
        before = load_insertions(config.insert_before)
    except ValueError as exc:
        print(f"llm-pipeline: cannot insert an operator: {exc}", file=sys.stderr)
        return 2
    try:
        output_options(config)
    except ValueError as exc:
        print(f"llm-pipeline: {exc}", file=sys.stderr)
        return 2
    metrics = ServerMetrics()
    async with contextlib.AsyncExitStack() as stack:
        workers = None
        kv_indexes: list[PrefixIndex] | None = None
        via = ""
        megabytes = config.responses_store_mb * 1024 * 1024
        store: ResponseStore = MemoryResponseStore(megabytes, config.responses_store_ttl)
        embedder: Embedder | None = None
        if config.nats is not None:
            from operators.contracts.transport import discover_workers

            nc = await connect_nats(config.nats, name="llm-pipeline serve")
            if nc is None:
                return 1
            stack.push_async_callback(close_nats, nc)
            try:
                workers = await stack.enter_async_context(
                    discover_workers(nc, model=config.model_name)
                )
            except Exception as exc:  # nats-py's errors, a server without JetStream
                print(f"llm-pipeline: cannot discover workers: {one_line(exc)}", file=sys.stderr)
                return 1
            via = f" with workers via {config.nats}"
            from operators.contracts.remote_embed import RemoteEmbedder
            from operators.edges.responses.nats_store import NatsResponseStore

            try:
                store = await NatsResponseStore.open(
                    nc, ttl=config.responses_store_ttl, max_bytes=megabytes
                )
            except Exception as exc:  # nats-py's errors, a server without JetStream
                print(f"llm-pipeline: cannot open the responses store: {exc}", file=sys.stderr)
                return 1
            embedder = RemoteEmbedder(nc, model=config.model_name, workers=workers.decode)
            if config.router == "kv":  # fed by the KV events the workers publish
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)
                kv_indexes = await follow_kv_events(
                    tg, nc, model=config.model_name, sets=(workers.decode, workers.prefill)
                )
        loaded: Any = None
        local: tuple[Any, Any] | None = None
        if workers is None and config.engine.engine == "llama":
            try:
                local = await _load_llama_sets(config, stack)
            except Exception as exc:  # the extra missing, a bad model file, llama.cpp failing
                print(f"llm-pipeline: cannot load the engine: {exc}", file=sys.stderr)
                return 1
            decode, prefill = local
            if len(decode) == 1 and config.prefill_workers == 0:
                loaded, local = decode.members[0].engine, None  # one model: no worker sets
            watch_llama(
                metrics,
                *(worker.engine for worker in decode.members),
                prefill=[] if prefill is None else [worker.engine for worker in prefill.members],
            )
        elif workers is None and config.engine.engine in MODEL_ENGINES:
            try:
                loaded = await load_engine(config.engine, log_level=config.log_level)
            except Exception as exc:  # the extra missing, a bad model, the engine failing
                print(f"llm-pipeline: cannot load the engine: {exc}", file=sys.stderr)
                return 1
            stack.push_async_callback(loaded.aclose)
            watch_engine(metrics, loaded)
        engine, options, groups = _engine_and_options(
            config, tokenizer, workers, loaded, metrics, kv_indexes, local
        )
        tracing = tracing_options(config.otlp_traces_endpoint, service_name=SERVICE_NAME)
        buffer = SpanBuffer() if config.ui else None
        tracer, exporter = make_tracer(
            tracing, buffer=buffer, request_log=config.log_format == "json"
        )
        if exporter is not None:
            stack.callback(exporter.shutdown)  # last: what the drain's requests recorded
        app = build_app(
            engine,
            tokenizer,
            model_name=config.model_name,
            guard=guard(config),
            metrics=metrics,
            before=before,
            responses_store=store,
            embedder=embedder,
            tracer=tracer,
            **options,
        )
        if config.ui:
            attach_ui(
                app,
                buffer=buffer,
                workers=None if groups is None else lambda: groups,
                where="in-process" if workers is None else "nats",
                engine_name=type(engine).__name__,
                exporting=None if exporter is None else exporter.endpoint,
            )

        def announce(host: str, port: int) -> None:
            print(
                f"llm-pipeline serving model {config.model_name!r} on "
                f"http://{_display_host(host)}:{port}{via}",
                flush=True,
            )

        await serve(
            app,
            host=config.host,
            port=config.port,
            on_ready=announce,
            log_level=config.log_level,
            drain_timeout=config.drain_timeout,
        )
    return 0
