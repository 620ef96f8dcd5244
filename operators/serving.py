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
(:mod:`operators.graph` names its stages). :func:`serve` runs it with uvicorn on the
current event loop; to stop it from Python, cancel the task running it
(``serve(..., handle_signals=False)`` inside a task group whose scope you cancel) —
in-flight requests are cut, as with a second signal. To test an app without a socket,
:func:`operators.testing.openai_client` gives the official ``openai.AsyncOpenAI`` client
talking to it in-process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

from pipeline import Router
from pipeline.tracing import Tracer

from .contracts.llm import embedder_of
from .edges.anthropic import AnthropicEdge
from .edges.http.guard import Guard
from .edges.http.metrics import ServerMetrics
from .edges.http.runner import serve
from .edges.openai.embeddings import embedding_routes
from .edges.openai.preprocessor import OpenAIPreprocessor
from .edges.openai.server import OpenAIApp
from .edges.openai.tokenize import tokenize_routes
from .edges.responses import ResponsesEdge
from .graph import GraphOptions, Point, default_stages
from .telemetry import SpanBuffer
from .ui import WorkerGroups, attach_ui

if TYPE_CHECKING:
    from pipeline import Engine, Operator

    from .contracts.llm import Embedder, EngineOutput, PreprocessedRequest
    from .edges.http.routes import Edge
    from .edges.responses import ResponseStore
    from .text.tokenizer import Tokenizer

__all__ = ("build_app", "serve")


def build_app(
    engine: Engine[PreprocessedRequest, EngineOutput],
    tokenizer: Tokenizer,
    *,
    model_name: str,
    guard: Guard | None = None,
    metrics: ServerMetrics | None = None,
    before: Mapping[Point, Sequence[Operator[Any, Any, Any, Any]]] | None = None,
    responses_store: ResponseStore | None = None,
    embedder: Embedder | None = None,
    edges: Sequence[Edge] = (),
    tracer: Tracer | None = None,
    ui: bool = False,
    **graph_options: Unpack[GraphOptions],
) -> OpenAIApp:
    """The OpenAI app serving ``engine`` behind the default graph, as ``model_name``.

    ``before`` inserts operators before named stages of the graph (or the engine), as in
    :func:`~operators.graph.default_graph`: ``before={"backend": [Redact()]}``.
    ``graph_options`` go to :func:`~operators.graph.default_stages` (``max_model_len``,
    ``default_max_tokens``, ``chat_template``, ``migration_limit``, worker sets...);
    ``guard`` sets API keys, admission control and deadlines. Migrations are counted in
    ``app.metrics`` unless ``on_migration`` is given. ``tracer`` traces every request
    (:mod:`pipeline.tracing`; e.g. exporting over OTLP, :mod:`operators.telemetry`);
    ``ui=True`` serves the web UI at ``/`` and its status view at ``/status``, with the
    last requests' stage timings (it records spans in process, in ``tracer`` if given).

    Besides chat completions and completions the app serves the Responses API (its
    responses kept in ``responses_store``: a bounded in-memory store by default), Anthropic's
    Messages API, ``/v1/embeddings`` (through ``embedder``, by default the engine itself if
    it has ``embed``), ``/tokenize`` and ``/detokenize``; ``edges`` adds APIs of your own
    (:class:`operators.edges.http.routes.Edge`).

    Raises:
        ValueError: a key of ``before`` names no stage of the default graph.
    """
    metrics = metrics if metrics is not None else ServerMetrics()
    graph_options.setdefault("on_migration", metrics.count_migration)
    stages = default_stages(tokenizer, model_name=model_name, **graph_options)
    graph = stages.insert(before or {}).link(engine)
    reasoning = graph_options.get("reasoning_parser") is not None
    preprocessor = stages.preprocessor
    own = preprocessor if isinstance(preprocessor, OpenAIPreprocessor) else None
    served: list[Edge] = [ResponsesEdge(responses_store, reasoning=reasoning), AnthropicEdge(own)]
    routes = [embedding_routes(embedder or embedder_of(engine), tokenizer)]
    if own is not None:
        context = getattr(engine, "n_ctx", None)  # (the llama engine's context length)
        routes.append(tokenize_routes(own, context=context if isinstance(context, int) else None))
    buffer = None
    if ui:
        buffer = SpanBuffer()
        if tracer is None:
            tracer = Tracer(buffer)
        else:
            tracer.add_sink(buffer)
    app = OpenAIApp(
        graph,
        model_name=model_name,
        metrics=metrics,
        guard=guard,
        edges=[*served, *edges],
        openai_routes=routes,
        tracer=tracer,
    )
    if ui:
        groups = _worker_groups(engine, graph_options)
        attach_ui(
            app,
            buffer=buffer,
            workers=None if groups is None else lambda: groups,
            engine_name=type(engine).__name__,
        )
    return app


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
