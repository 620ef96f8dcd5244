"""``llm-pipeline serve``: the default graph over in-process or discovered workers, served
over HTTP until SIGINT/SIGTERM.

The graph and the app are built by :func:`operators.serving.build_app` (and so by
:func:`operators.graph.default_graph`), exactly as a user serving from Python builds
them; this module only chooses the engine and worker sets the config asks for: one model,
each model of ``--models FILE`` (a graph, tokenizer and engine of its own), or with
``--nats`` and no ``--model-name`` every model workers register (:mod:`.discovered`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from operators.contracts.adapters import EveryWorker
from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.edges.http.metrics import ServerMetrics
from operators.edges.http.models import Models
from operators.edges.http.runner import CannotListen
from operators.edges.responses import MemoryResponseStore
from operators.graph import default_graph
from operators.serving import ModelSpec, build_app, serve
from operators.telemetry import SpanBuffer, make_tracer, tracing_options
from operators.ui import attach_ui
from pipeline import Engine, EngineDead, WorkerSet

from .config import ServeConfig
from .defaults import MODEL_ENGINES
from .discovered import DiscoveredModels
from .engines import (
    load_engine,
    load_llama_workers,
    load_tokenizer,
    open_remote,
    watch_engines,
    watch_upstreams,
)
from .health import supervise
from .insertions import load_insertions
from .keys import guard, open_budgets, reloader
from .model_graph import engine_and_options
from .nats import KvFeed, close_nats, connect_nats, follow_kv_events, follow_planner, one_line
from .observability import SERVICE_NAME
from .output_options import output_options

if TYPE_CHECKING:
    from nats.aio.client import Client

    from operators.contracts.llm import Embedder, LoraEngine
    from operators.contracts.transport import WorkerSets
    from operators.edges.openai.events import OpenAIEvent
    from operators.edges.openai.preprocessor import OpenAIRequest
    from operators.edges.responses import ResponseStore
    from operators.engines.remote import UpstreamFleet
    from operators.text.tokenizer import Tokenizer
    from operators.ui import WorkerGroups

__all__ = ("build_graph", "run_serve")

_Workers = WorkerSet[PreprocessedRequest, EngineOutput]
_Engine = Engine[PreprocessedRequest, EngineOutput]


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
    engine, options, _ = engine_and_options(config, tokenizer, workers, engine, metrics)
    options["on_migration"] = metrics.count_migration
    before = load_insertions(config.insert_before)
    return default_graph(engine, tokenizer, model_name=config.model_name, before=before, **options)


async def _load_llama_sets(
    config: ServeConfig, stack: contextlib.AsyncExitStack
) -> tuple[_Workers, _Workers | None]:
    """The in-process llama workers ``config`` asks for: (decode or aggregated, prefill),
    each under watch (rebuilt as it was loaded when it dies) and closed when ``stack``
    unwinds."""
    sets: list[_Workers | None] = []
    roles = (("decode" if config.prefill_workers else "aggregated", config.decode_workers),)
    shared = config.prefill_workers + config.decode_workers > 1

    def supervised(engine: Any, worker_id: str, factory: Any) -> Any:
        return supervise(engine, config, name=worker_id, factory=factory)

    for role, count in (*roles, ("prefill", config.prefill_workers)):
        workers = await load_llama_workers(
            config.engine, role, count, shared=shared, supervise=supervised
        )
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


def _check(config: ServeConfig) -> str | None:
    """What cannot be loaded of each model's insertions, parsers and template (None: all
    can), said as the error line."""
    for model in config.served:
        try:
            load_insertions(model.insert_before)
        except ValueError as exc:
            return f"cannot insert an operator: {exc}"
        try:
            output_options(model)
        except ValueError as exc:
            return str(exc)
    return None


async def _tokenizers(config: ServeConfig, tokenizer: Tokenizer) -> list[Tokenizer]:
    """Each model's tokenizer: ``tokenizer`` (the command line's) for the one model of a
    plain ``serve``, else each model's own, loaded once per path.

    Raises:
        Exception: a tokenizer cannot be loaded (tokenizers raises plain ``Exception``).
    """
    if not config.models:
        return [tokenizer]
    loaded: dict[Path | None, Tokenizer] = {config.engine.tokenizer_path: tokenizer}
    found = []
    for model in config.models:
        path = model.engine.tokenizer_path
        if path not in loaded:
            loaded[path] = await anyio.to_thread.run_sync(load_tokenizer, path)
        found.append(loaded[path])
    return found


async def run_serve(config: ServeConfig, tokenizer: Tokenizer) -> int:
    """Serve until SIGINT/SIGTERM (then drain); the exit code (1: no NATS, no engine, or an
    engine died beyond recovery; 2: an operator to insert, a parser, the chat template or a
    model's tokenizer cannot be loaded, or the host and port cannot be listened on)."""
    problem = _check(config)
    if problem is not None:
        print(f"llm-pipeline: {problem}", file=sys.stderr)
        return 2
    try:
        protections = guard(config)
    except ValueError as exc:  # the keys file (naming its line), a key given twice
        print(f"llm-pipeline: {exc}", file=sys.stderr)
        return 2
    try:
        tokenizers = await _tokenizers(config, tokenizer)
    except Exception as exc:  # tokenizers raises plain Exception for a missing file
        print(f"llm-pipeline: cannot load a model's tokenizer: {exc}", file=sys.stderr)
        return 2
    metrics = ServerMetrics()
    async with contextlib.AsyncExitStack() as stack:
        megabytes = config.responses_store_mb * 1024 * 1024
        store: ResponseStore = MemoryResponseStore(megabytes, config.responses_store_ttl)
        nc = None
        if config.nats is not None:
            nc = await connect_nats(config.nats, name="llm-pipeline serve")
            if nc is None:
                return 1
            stack.push_async_callback(close_nats, nc)
        groups: Mapping[str, WorkerGroups] = {}
        specs: dict[str, ModelSpec] = {}
        engine_name = "engine"
        discovered: DiscoveredModels | None = None
        try:
            if nc is not None and config.engine.model_name is None:  # every model
                discovered = DiscoveredModels(
                    nc,
                    Models(),
                    config=config,
                    tokenizer=tokenizer,
                    metrics=metrics,
                    before=load_insertions(config.insert_before),
                )
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)
                try:
                    await tg.start(discovered.run)
                except Exception as exc:  # nats-py's errors, a server without JetStream
                    raise _Unavailable(f"cannot discover workers: {one_line(exc)}") from exc
                groups, engine_name = discovered.groups, "Router"
            else:
                specs, groups, engine_name = await _served_models(
                    config, tokenizers, nc, metrics, stack
                )
            if nc is not None:
                store = await _nats_store(nc, config, megabytes)
            if nc is not None and config.api_keys_file is not None:
                try:
                    protections.budgets = await open_budgets(nc, stack)
                except Exception as exc:  # nats-py's errors, a server without JetStream
                    raise _Unavailable(f"cannot share the keys' limits: {exc}") from exc
        except _Unavailable as exc:
            print(f"llm-pipeline: {exc}", file=sys.stderr)
            return 1
        tracing = tracing_options(config.otlp_traces_endpoint, service_name=SERVICE_NAME)
        buffer = SpanBuffer() if config.ui else None
        tracer, exporter = make_tracer(
            tracing, buffer=buffer, request_log=config.log_format == "json"
        )
        if exporter is not None:
            stack.callback(exporter.shutdown)  # last: what the drain's requests recorded
        app = build_app(
            models=specs,
            guard=protections,
            metrics=metrics,
            responses_store=store,
            tracer=tracer,
            lora_dir=config.lora_dir,
            reasoning_parser=output_options(config).get("reasoning_parser"),
            stall_timeout=config.stall_timeout or None,
            canary_interval=config.canary_interval,
        )
        if discovered is not None:
            discovered.attach(app.models, app.health)
        planner = None if nc is None else await follow_planner(stack, nc, metrics)
        if config.ui:
            attach_ui(
                app,
                buffer=buffer,
                workers=_merged(groups) if groups or discovered is not None else None,
                where="in-process" if nc is None else "nats",
                engine_name=engine_name,
                exporting=None if exporter is None else exporter.endpoint,
                planner=planner,
            )

        path = config.api_keys_file

        def announce(host: str, port: int) -> None:
            url = f"http://{_display_host(host)}:{port}"
            if discovered is not None:
                where = f"with workers via {config.nats} (every model its workers register)"
                print(f"llm-pipeline serving model '*' on {url} {where}", flush=True)
                return
            first, *rest = specs
            via = "" if nc is None else f" with workers via {config.nats}"
            more = f" (and {', '.join(repr(name) for name in rest)})" if rest else ""
            print(f"llm-pipeline serving model {first!r} on {url}{via}{more}", flush=True)

        try:
            await serve(
                app,
                host=config.host,
                port=config.port,
                on_ready=announce,
                log_level=config.log_level,
                drain_timeout=config.drain_timeout,
                max_header_bytes=config.max_header_bytes,
                on_hangup=None if path is None else reloader(path, protections),
            )
        except CannotListen as exc:
            print(f"llm-pipeline: {exc.strerror}", file=sys.stderr)
            return 2
        except EngineDead:  # (serve logged why, once)
            return 1
    return 0


class _Unavailable(Exception):
    """A model's engine or workers cannot be had (exit code 1)."""


async def _nats_store(nc: Client, config: ServeConfig, megabytes: int) -> ResponseStore:
    """The Responses store in NATS JetStream.

    Raises:
        _Unavailable: the bucket cannot be opened.
    """
    from operators.edges.responses.nats_store import NatsResponseStore

    try:
        return await NatsResponseStore.open(nc, ttl=config.responses_store_ttl, max_bytes=megabytes)
    except Exception as exc:  # nats-py's errors, a server without JetStream
        raise _Unavailable(f"cannot open the responses store: {exc}") from exc


async def _served_models(
    config: ServeConfig,
    tokenizers: Sequence[Tokenizer],
    nc: Client | None,
    metrics: ServerMetrics,
    stack: contextlib.AsyncExitStack,
) -> tuple[dict[str, ModelSpec], dict[str, WorkerGroups], str]:
    """Each model of ``config`` as :func:`~operators.serving.build_app` takes it, its worker
    sets by role, and the (first) engine's class name. With ``nc``, the one model's workers
    are discovered over NATS; otherwise model engines are loaded (closed by ``stack``).

    Raises:
        _Unavailable: no workers can be discovered, or an engine cannot be loaded.
    """
    specs: dict[str, ModelSpec] = {}
    groups: dict[str, WorkerGroups] = {}
    engines: list[Any] = []
    prefill_engines: list[Any] = []
    fleets: list[UpstreamFleet] = []
    engine_name = "engine"
    for model, tokenizer in zip(config.served, tokenizers, strict=True):
        name = model.model_name
        workers: WorkerSets | None = None
        kv_feeds: list[KvFeed] | None = None
        embedder: Embedder | None = None
        loaded: Any = None
        local: tuple[_Workers, _Workers | None] | None = None
        lora: LoraEngine | None = None
        if nc is not None:
            from operators.contracts.remote_embed import RemoteEmbedder
            from operators.contracts.transport import discover_workers

            try:
                workers = await stack.enter_async_context(discover_workers(nc, model=name))
            except Exception as exc:  # nats-py's errors, a server without JetStream
                raise _Unavailable(f"cannot discover workers: {one_line(exc)}") from exc
            embedder = RemoteEmbedder(nc, model=name, workers=workers.decode)
            if model.router == "kv":  # fed by the KV events the workers publish
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)
                kv_feeds = await follow_kv_events(
                    tg, nc, model=name, sets=(workers.decode, workers.prefill)
                )
        elif model.engine.engine == "llama":
            try:
                decode, prefill = await _load_llama_sets(model, stack)
            except Exception as exc:  # the extra missing, a bad model file, llama.cpp failing
                raise _Unavailable(f"cannot load the engine of {name!r}: {exc}") from exc
            engines.extend(worker.engine for worker in decode.members)
            if prefill is not None:
                prefill_engines.extend(worker.engine for worker in prefill.members)
            if len(decode) == 1 and prefill is None:
                loaded = decode.members[0].engine  # one engine: no worker sets
            else:
                local = (decode, prefill)
                workers_of = [*decode.members, *(prefill.members if prefill else ())]
                each: list[Any] = [worker.engine for worker in workers_of]
                lora = EveryWorker(each)  # (llama engines: each takes adapters)
        elif model.engine.engine == "remote":
            try:
                fleet = await stack.enter_async_context(open_remote(model.engine, tokenizer))
            except (ConnectionError, ValueError, ImportError) as exc:
                what = repr(name) if name else "the model"
                raise _Unavailable(f"cannot serve the upstreams of {what}: {exc}") from exc
            fleets.append(fleet)
            name = name or fleet.model  # (the upstream's, unless --model-name says)
            local = (fleet.workers, None)
        elif model.engine.engine in MODEL_ENGINES:
            factory = functools.partial(load_engine, model.engine, log_level=config.log_level)
            try:
                loaded = await factory()
            except Exception as exc:  # the extra missing, a bad model, the engine failing
                raise _Unavailable(f"cannot load the engine of {name!r}: {exc}") from exc
            loaded = supervise(loaded, model, name=name, factory=factory)
            stack.push_async_callback(loaded.aclose)
            engines.append(loaded)
        engine, options, found = engine_and_options(
            model, tokenizer, workers, loaded, metrics, kv_feeds, local
        )
        if not specs:
            engine_name = type(engine).__name__
        specs[name] = ModelSpec(
            engine=engine,
            tokenizer=tokenizer,
            options=options,
            before=load_insertions(model.insert_before),
            embedder=embedder,
            root=None if model.engine.model is None else str(model.engine.model),
            lora=lora,
        )
        if found is not None:
            groups[name] = found
    if engines:
        watch_engines(metrics.registry, engines, prefill=prefill_engines)
    if fleets:
        watch_upstreams(metrics.registry, fleets)
    return specs, groups, engine_name


def _merged(groups: Mapping[str, WorkerGroups]) -> Callable[[], WorkerGroups]:
    """The status view's worker sets: one model's by role, several models' by model and
    role (read at each call: discovered models come and go)."""

    def merged() -> WorkerGroups:
        current = dict(groups)
        if len(current) == 1:
            return next(iter(current.values()))
        return {
            f"{model} {role}": workers
            for model, by_role in current.items()
            for role, workers in by_role.items()
        }

    return merged
