"""The OpenAI-compatible HTTP server: :class:`OpenAIApp`, the app with the OpenAI edge.

::

    POST /v1/chat/completions   ChatCompletionRequest --[graph]--> events -> chat.completion.chunk
    POST /v1/completions        CompletionRequest     --[graph]--> events -> text_completion
    GET  /v1/models, /v1/models/{model}, /health, /metrics
    ... and the routes of every other edge given (``build_app`` adds Responses and Messages)

The app does not care what is inside the graph: an edge parses a request body into what
the graph takes, :mod:`operators.edges.http` runs ``graph.generate(ctx)`` under
:func:`pipeline.open_stream` (admission, deadlines, request ids, disconnect -> kill, drain,
metrics), and the edge's reply writes the typed events the graph yields (:mod:`.events`),
either as server-sent events or, aggregated, as one JSON response. Every failure is
answered in OpenAI's error shape (:mod:`.errors`).

With a :class:`~pipeline.tracing.Tracer` every generation request gets a span
(:mod:`operators.edges.http.request_span`: HTTP and GenAI attributes) that the graph's
stages hang under; a ``pages`` handler (the web UI, :mod:`operators.ui`) answers the GET
paths the API does not.

A client that disconnects kills its request down to the engine (``ctx.kill()``). For
shutdown, :meth:`OpenAIApp.drain` refuses new requests and lets the in-flight ones finish;
:meth:`OpenAIApp.abort` ends what is left with an error (a stream never gets a finish
reason it did not earn). :func:`operators.edges.http.runner.serve` serves the app with
uvicorn; :mod:`operators.edges.http.metrics` has the series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, final

from operators.edges.http.app import MAX_BODY_BYTES, EdgeApp

from .edge import CHAT_COMPLETIONS, COMPLETIONS, OpenAIEdge
from .errors import OPENAI_ERRORS

if TYPE_CHECKING:
    from operators.edges.http.app import Pages
    from operators.edges.http.guard import Guard
    from operators.edges.http.metrics import ServerMetrics
    from operators.edges.http.models import Models, ServedModel
    from operators.edges.http.routes import Edge, Host, Route
    from pipeline import Engine
    from pipeline.health import Health
    from pipeline.tracing import Tracer

    from .events import OpenAIEvent
    from .preprocessor import OpenAIRequest

__all__ = (
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "MAX_BODY_BYTES",
    "OpenAIApp",
)


@final
class OpenAIApp(EdgeApp):
    """The ASGI app: OpenAI endpoints over ``graph``, serving one model name, or over the
    graphs of several ``models``.

    Args:
        graph: takes a validated :data:`OpenAIRequest` and yields its response's
            :mod:`~operators.edges.openai.events` (usually :func:`operators.graph.default_graph`).
        model_name: the one model served; a request naming another gets 404 (a request
            that names none is served).
        models: instead of ``graph`` and ``model_name``, the models served, each with its
            graph (:class:`~operators.edges.http.models.ServedModel`; ``build_app`` makes
            them); requests are routed by their ``model``.
        metrics: where to count (a fresh :class:`ServerMetrics`, own registry, if None).
        max_body_bytes: larger request bodies get 413.
        guard: API keys, admission control and deadlines (:class:`~.guard.Guard`; none of
            them by default).
        edges: more APIs served beside OpenAI's (the Responses and Messages edges, your own).
        openai_routes: more OpenAI-shaped routes, built per app (embeddings, tokenize).
        tracer: traces every generation request, whichever its edge (None: none is traced).
        pages: answers the GET paths no edge serves (the web UI, :mod:`operators.ui`).
        health: the models' health (:class:`pipeline.health.Health`): ``/live``,
            ``/ready``, ``/health``, and requests refused at once when no engine answers.
    """

    def __init__(
        self,
        graph: Engine[OpenAIRequest, OpenAIEvent] | None = None,
        *,
        model_name: str | None = None,
        models: Models | Iterable[ServedModel] | None = None,
        metrics: ServerMetrics | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        guard: Guard | None = None,
        edges: Iterable[Edge] = (),
        openai_routes: Iterable[Callable[[Host], list[Route]]] = (),
        tracer: Tracer | None = None,
        pages: Pages | None = None,
        health: Health | None = None,
    ) -> None:
        super().__init__(
            graph,
            model_name=model_name,
            models=models,
            edges=[OpenAIEdge(*openai_routes), *edges],
            errors=OPENAI_ERRORS,
            metrics=metrics,
            max_body_bytes=max_body_bytes,
            guard=guard,
            tracer=tracer,
            pages=pages,
            health=health,
        )
