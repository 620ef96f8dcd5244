"""Serving a graph from Python: :func:`build_app` and :func:`serve`, the CLI's own path.

``llm-pipeline serve`` is this module plus argument parsing. From Python::

    from operators.serving import build_app, serve
    from operators.engines import EchoEngine
    from operators.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.default()
    app = build_app(EchoEngine.from_tokenizer(tokenizer), tokenizer, model_name="echo")
    anyio.run(serve, app)                      # until SIGINT/SIGTERM (drains, exit code 0)

:func:`build_app` puts the default graph (:func:`operators.graph.default_graph`) in front of
an engine, names the model once, and wires the metrics (migrations included) into
``app.metrics``; ``before={"backend": [MyOperator()]}`` splices operators into that graph
(:mod:`operators.graph` names its stages). Several models, each its own engine, tokenizer
and graph, are served by one app the same way::

    app = build_app({"smol": (engine, tokenizer), "echo": ModelSpec(echo, tokenizer,
                     options={"chat_template": template})})

Every engine is watched (:mod:`pipeline.health`): ``app.health`` tells ``/live``,
``/ready`` and ``/health``; an engine that stalls has its requests failed over (503
``engine_unavailable``, or another worker) instead of hanging them. A dead engine is
rebuilt when it was given as a :class:`~pipeline.health.Supervised` with a factory::

    engine = Supervised(factory=load_my_engine, probe=one_token_probe, restarts=3)
    app = build_app(engine, tokenizer, model_name="mine", stall_timeout=30.0)

Requests are routed by their ``model`` field (:mod:`operators.edges.http.models`);
:func:`build_model` is the one path every model's graph is built through, also for models
added while the app serves (``app.models.add(build_model(...))``, as ``serve --nats`` does
for the models its workers register). :func:`serve` runs it with uvicorn on the
current event loop; to stop it from Python, cancel the task running it
(``serve(..., handle_signals=False)`` inside a task group whose scope you cancel) —
in-flight requests are cut, as with a second signal. To test an app without a socket,
:func:`operators.testing.openai_client` gives the official ``openai.AsyncOpenAI`` client
talking to it in-process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack, overload

from pipeline import Router
from pipeline.health import Health, Supervised
from pipeline.tracing import Tracer

from .contracts.llm import embedder_of, lora_engine_of
from .contracts.probe import one_token_probe
from .edges.anthropic import AnthropicEdge
from .edges.http.guard import Guard
from .edges.http.metrics import ServerMetrics
from .edges.http.models import ServedModel
from .edges.http.runner import serve
from .edges.openai.embeddings import embedding_routes
from .edges.openai.lora import lora_routes
from .edges.openai.preprocessor import OpenAIPreprocessor
from .edges.openai.server import OpenAIApp
from .edges.openai.tokenize import tokenize_routes
from .edges.responses import ResponsesEdge
from .edges.tokens import TokensEdge
from .graph import GraphOptions, Point, default_stages
from .telemetry import SpanBuffer
from .ui import WorkerGroups, attach_ui

if TYPE_CHECKING:
    from pipeline import Engine, Operator, WorkerSet

    from .contracts.llm import Embedder, EngineOutput, LoraEngine, PreprocessedRequest
    from .edges.http.routes import Edge
    from .edges.responses import ResponseStore
    from .text.tokenizer import Tokenizer

__all__ = ("ModelSpec", "adapter_models", "build_app", "build_model", "serve", "supervise_model")

_Before = Mapping[Point, Sequence["Operator[Any, Any, Any, Any]"]]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model of a :func:`build_app` of several: its engine, tokenizer and graph.

    ``options`` are this model's :class:`~operators.graph.GraphOptions` (its
    ``chat_template``, ``tool_call_parser``, ``max_model_len``...), over the ones
    ``build_app`` was given for every model; ``before`` inserts operators into its graph
    only; ``embedder`` serves its ``/v1/embeddings`` (default: the engine, if it embeds);
    ``root`` is where it was loaded from (its model card's ``root``); ``lora`` loads and
    unloads its adapters (default: the engine, if it declares ``LORA``; for several
    in-process workers, :class:`~operators.contracts.adapters.EveryWorker`).
    """

    engine: Engine[PreprocessedRequest, EngineOutput]
    tokenizer: Tokenizer
    options: GraphOptions = field(default_factory=lambda: GraphOptions())
    before: _Before | None = None
    embedder: Embedder | None = None
    root: str | None = None
    lora: LoraEngine | None = None


ModelEntry = ModelSpec | tuple["Engine[PreprocessedRequest, EngineOutput]", "Tokenizer"]
"""A model of :func:`build_app`: a :class:`ModelSpec`, or just (engine, tokenizer)."""


def build_model(
    name: str,
    engine: Engine[PreprocessedRequest, EngineOutput],
    tokenizer: Tokenizer,
    *,
    before: _Before | None = None,
    embedder: Embedder | None = None,
    root: str | None = None,
    lora: LoraEngine | None = None,
    **graph_options: Unpack[GraphOptions],
) -> ServedModel:
    """The default graph in front of ``engine``, served as ``name``: what an app's
    ``models`` hold (:class:`~operators.edges.http.models.ServedModel`).

    ``before`` and ``graph_options`` are :func:`~operators.graph.default_graph`'s; the
    model's ``/v1/embeddings`` go to ``embedder`` (default: the engine, if it has
    ``embed``), its ``/tokenize`` and ``count_tokens`` through the graph's preprocessor.
    An engine that declares ``LORA`` (or ``lora``, for an engine routing to several that
    do) runs requests naming its adapters (the graph reads ``loras``); :func:`adapter_models`
    lists them as models of their own.

    Raises:
        ValueError: a key of ``before`` names no stage, a parser is not registered, or the
            chat template does not compile.
    """
    if lora is None:
        lora = lora_engine_of(engine)
    if lora is not None:
        graph_options.setdefault("adapters", lora.loras)
    stages = default_stages(tokenizer, model_name=name, **graph_options).insert(before or {})
    graph = stages.link(engine)
    preprocessor = stages.preprocessor
    context = getattr(engine, "n_ctx", None)  # (the llama engine's context length)
    return ServedModel(
        name=name,
        graph=graph,
        root=root,
        preprocessor=preprocessor if isinstance(preprocessor, OpenAIPreprocessor) else None,
        embedder=embedder if embedder is not None else embedder_of(engine),
        context=context if isinstance(context, int) else None,
        lora=lora,
        tokens=stages.link_tokens(engine),
    )


def adapter_models(model: ServedModel) -> list[ServedModel]:
    """The adapters loaded in ``model``'s engine, each served as a model whose ``parent``
    is ``model`` (empty when its engine takes none)."""
    lora = model.lora
    if lora is None:
        return []
    return [model.adapter(name, root) for name, root in lora.loras.items()]


@overload
def build_app(
    engine: Engine[PreprocessedRequest, EngineOutput],
    tokenizer: Tokenizer,
    *,
    model_name: str,
    guard: Guard | None = ...,
    metrics: ServerMetrics | None = ...,
    before: _Before | None = ...,
    responses_store: ResponseStore | None = ...,
    embedder: Embedder | None = ...,
    edges: Sequence[Edge] = ...,
    tracer: Tracer | None = ...,
    ui: bool = ...,
    lora_dir: Path | None = ...,
    health: Health | None = ...,
    stall_timeout: float | None = ...,
    canary_interval: float = ...,
    **graph_options: Unpack[GraphOptions],
) -> OpenAIApp: ...
@overload
def build_app(
    engine: Mapping[str, ModelEntry] | None = ...,
    tokenizer: None = ...,
    *,
    models: Mapping[str, ModelEntry] | None = ...,
    guard: Guard | None = ...,
    metrics: ServerMetrics | None = ...,
    before: _Before | None = ...,
    responses_store: ResponseStore | None = ...,
    edges: Sequence[Edge] = ...,
    tracer: Tracer | None = ...,
    ui: bool = ...,
    lora_dir: Path | None = ...,
    health: Health | None = ...,
    stall_timeout: float | None = ...,
    canary_interval: float = ...,
    **graph_options: Unpack[GraphOptions],
) -> OpenAIApp: ...
def build_app(
    engine: Engine[PreprocessedRequest, EngineOutput] | Mapping[str, ModelEntry] | None = None,
    tokenizer: Tokenizer | None = None,
    *,
    model_name: str | None = None,
    models: Mapping[str, ModelEntry] | None = None,
    guard: Guard | None = None,
    metrics: ServerMetrics | None = None,
    before: _Before | None = None,
    responses_store: ResponseStore | None = None,
    embedder: Embedder | None = None,
    edges: Sequence[Edge] = (),
    tracer: Tracer | None = None,
    ui: bool = False,
    lora_dir: Path | None = None,
    health: Health | None = None,
    stall_timeout: float | None = 30.0,
    canary_interval: float = 0.0,
    **graph_options: Unpack[GraphOptions],
) -> OpenAIApp:
    """The OpenAI app serving ``engine`` behind the default graph, as ``model_name``; or
    several models, each behind a graph of its own (``models``, or a mapping in place of
    ``engine``: name -> (engine, tokenizer) or :class:`ModelSpec`; none at first is fine
    for models added later with :func:`build_model`).

    ``before`` inserts operators before named stages of the graph (or the engine), as in
    :func:`~operators.graph.default_graph`: ``before={"backend": [Redact()]}``.
    ``graph_options`` go to :func:`~operators.graph.default_stages` (``max_model_len``,
    ``default_max_tokens``, ``chat_template``, ``migration_limit``, worker sets...);
    with several models, both apply to every model, under each :class:`ModelSpec`'s own.
    ``guard`` sets API keys, admission control and deadlines. Migrations are counted in
    ``app.metrics`` unless ``on_migration`` is given. ``tracer`` traces every request
    (:mod:`pipeline.tracing`; e.g. exporting over OTLP, :mod:`operators.telemetry`);
    ``ui=True`` serves the web UI at ``/`` and its status view at ``/status``, with the
    last requests' stage timings (it records spans in process, in ``tracer`` if given).
    A model whose engine takes adapters (LoRA) serves each as a model of its own (its
    ``parent`` the base model), and ``POST /v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` change them at run time (only files under ``lora_dir``,
    when given).

    Every model's engine is watched (:func:`supervise_model`) in ``health`` (a fresh
    :class:`~pipeline.health.Health` if None; ``app.health``): an engine with requests
    waiting that makes no progress for ``stall_timeout`` seconds (None: never) is stalled,
    and one idle for ``canary_interval`` seconds (0: never) gets a one-token canary.
    :func:`serve` runs the watchdog; in a test, run ``app.health.run`` in a task group.

    A request is routed by its ``model`` field (none: the first model); an unknown model is
    a 404 (``model_not_found``); ``/v1/models`` lists them all. Besides chat completions
    and completions the app serves the Responses API (its responses kept in
    ``responses_store``: a bounded in-memory store by default), Anthropic's Messages API,
    ``/v1/embeddings`` (through ``embedder``, by default the engine itself if it has
    ``embed``), ``/tokenize`` and ``/detokenize``; ``edges`` adds APIs of your own
    (:class:`operators.edges.http.routes.Edge`).

    Raises:
        ValueError: a key of ``before`` names no stage of the default graph.
        TypeError: neither one engine (with its tokenizer and name) nor models were given.
    """
    specs = _specs(engine, tokenizer, model_name, models, embedder)
    metrics = metrics if metrics is not None else ServerMetrics()
    health = health if health is not None else Health()
    graph_options.setdefault("on_migration", metrics.count_migration)
    served = []
    groups: dict[str, WorkerSet[Any, Any] | None] = {}
    for name, spec in specs.items():
        options: GraphOptions = {**graph_options, **spec.options}
        merged = {**(before or {}), **(spec.before or {})}
        watched = supervise_model(
            name, spec.engine, health, stall_timeout=stall_timeout, canary_interval=canary_interval
        )
        for workers in (options.get("prefill_workers"), options.get("encode_workers")):
            _watch_members(name, workers, health, serves=False)
        served.append(
            build_model(
                name,
                watched,
                spec.tokenizer,
                before=merged,
                embedder=spec.embedder,
                root=spec.root,
                lora=spec.lora,
                **options,
            )
        )
        found = _worker_groups(spec.engine, options)
        if found is not None:
            prefix = "" if len(specs) == 1 else f"{name} "
            groups.update({f"{prefix}{role}": workers for role, workers in found.items()})
    served.extend([adapter for base in list(served) for adapter in adapter_models(base)])
    anthropic = AnthropicEdge()
    routes = [embedding_routes(), tokenize_routes(), lora_routes(lora_dir)]
    buffer = None
    if ui:
        buffer = SpanBuffer()
        if tracer is None:
            tracer = Tracer(buffer)
        else:
            tracer.add_sink(buffer)
    app = OpenAIApp(
        models=served,
        metrics=metrics,
        guard=guard,
        edges=[ResponsesEdge(responses_store), anthropic, TokensEdge(), *edges],
        openai_routes=routes,
        tracer=tracer,
        health=health,
    )
    if ui:
        engine_name = type(next(iter(specs.values())).engine).__name__
        attach_ui(
            app,
            buffer=buffer,
            workers=(lambda: groups) if groups else None,
            engine_name=engine_name,
        )
    return app


def supervise_model(
    name: str,
    engine: Engine[PreprocessedRequest, EngineOutput],
    health: Health,
    *,
    stall_timeout: float | None = 30.0,
    canary_interval: float = 0.0,
) -> Engine[PreprocessedRequest, EngineOutput]:
    """``engine`` as model ``name`` serves it, watched in ``health``.

    A plain engine is put under a :class:`~pipeline.health.Supervised` gate (probed with
    :func:`~operators.contracts.probe.one_token_probe`; no factory, so its death is beyond
    recovery); a ``Supervised`` one (the command line's, a user's with a factory) is
    watched as it is. A Router's workers are watched each, and kept in its worker set only
    while ready, when they are supervised; otherwise the set itself tells the model's
    readiness (remote workers: their discovery keeps it to the ready ones).
    """
    if isinstance(engine, Router):
        _watch_members(name, engine.workers, health, serves=True)
        return engine
    if not isinstance(engine, Supervised):
        engine = Supervised(
            engine,
            name=name,
            stall_timeout=stall_timeout,
            probe=one_token_probe,
            canary_interval=canary_interval,
        )
    health.watch(name, engine)
    return engine


def _watch_members(
    name: str, workers: WorkerSet[Any, Any] | None, health: Health, *, serves: bool
) -> None:
    if workers is None:
        return
    supervised = [(w.id, w.engine) for w in workers.members if isinstance(w.engine, Supervised)]
    if not supervised:
        if serves:
            health.watch(name, workers)
        return
    for worker_id, engine in supervised:
        engine.member_of(workers, worker_id)
        health.watch(name, engine, serves=serves)


def _specs(
    engine: Engine[PreprocessedRequest, EngineOutput] | Mapping[str, ModelEntry] | None,
    tokenizer: Tokenizer | None,
    model_name: str | None,
    models: Mapping[str, ModelEntry] | None,
    embedder: Embedder | None,
) -> dict[str, ModelSpec]:
    if isinstance(engine, Mapping):
        if models is not None:
            raise TypeError("give the models once: as the first argument or as models=")
        models, engine = engine, None
    if models is not None:
        if engine is not None or tokenizer is not None or model_name is not None:
            raise TypeError("with models=, give no engine, tokenizer or model_name")
        return {
            name: entry if isinstance(entry, ModelSpec) else _pair(name, entry)
            for name, entry in models.items()
        }
    if engine is None or tokenizer is None or model_name is None:
        raise TypeError("give an engine, its tokenizer and model_name, or models")
    return {model_name: ModelSpec(engine=engine, tokenizer=tokenizer, embedder=embedder)}


def _pair(name: str, entry: Any) -> ModelSpec:
    try:
        engine, tokenizer = entry
    except (TypeError, ValueError):
        raise TypeError(
            f"model {name!r}: expected (engine, tokenizer) or a ModelSpec, got {entry!r}"
        ) from None
    return ModelSpec(engine=engine, tokenizer=tokenizer)


def _worker_groups(engine: object, options: GraphOptions) -> WorkerGroups | None:
    """The worker sets behind ``engine`` and the graph's routers, by role (None: the
    engine is a single one)."""
    prefill = options.get("prefill_workers")
    encode = options.get("encode_workers")
    decode = engine.workers if isinstance(engine, Router) else None
    if decode is None and prefill is None and encode is None:
        return None
    return {
        "decode" if prefill is not None else "aggregated": decode,
        "prefill": prefill,
        "encode": encode,
    }
