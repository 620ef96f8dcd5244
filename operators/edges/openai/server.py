"""The OpenAI-compatible HTTP edge: :class:`OpenAIApp`, a raw ASGI app over a serving graph.

The app does not care what is inside the graph: it parses a request body into a protocol
model, runs ``graph.generate(ctx)`` under :func:`pipeline.open_stream`, and writes the
typed events the graph yields (:mod:`.events`), either as server-sent events or,
aggregated, as one JSON response::

    POST /v1/chat/completions   ChatCompletionRequest --[graph]--> events -> chat.completion.chunk
    POST /v1/completions        CompletionRequest     --[graph]--> events -> text_completion
    GET  /v1/models, /v1/models/{model}, /health, /metrics

Every failure is answered in OpenAI's error shape; :mod:`.errors` has the mapping from
exceptions and refusals to status codes (and the bodies), and what a failed stream looks
like.

Why it is raw ASGI and not a framework route: the per-token path is "render the event to
bytes once (:mod:`.sse`), buffer it, write". Writes are coalesced, events are not
(:mod:`.sse_writer`): every event is its own SSE ``data:`` line, but the events that are
ready when the server asks for the next one leave in one socket write, made the moment the
graph would wait. Nothing is written before the first visible text, so the role chunk
travels with the first token, an error before any output still gets its proper status
code, and the finish chunk, usage and ``[DONE]`` leave in one write. The graph always ends
with a :class:`~.events.Usage` (the server's token count); the renderer writes it only when
the client asked for it. :mod:`.asgi` has the plumbing every endpoint shares.

With a :class:`~pipeline.tracing.Tracer` every generation request gets a span
(:mod:`.request_span`: HTTP and GenAI attributes) that the graph's stages hang under; a
``pages`` handler (the web UI, :mod:`operators.ui`) answers the GET paths the API does not.

A client that disconnects kills its request down to the engine (``ctx.kill()``), noticed
by a watcher task waiting on ``http.disconnect``. A request's deadline (:mod:`.guard`) is a
kill too, answered with the timeout error. For shutdown, :meth:`OpenAIApp.drain` refuses
new requests and lets the in-flight ones finish; :meth:`OpenAIApp.abort` ends what is left
with an error (a stream never gets a finish reason it did not earn).
:mod:`operators.edges.openai.runner` serves the app with uvicorn; :mod:`.metrics` has the series.
"""

from __future__ import annotations

import logging
import time
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import orjson

from pipeline import Context, InvalidRequest, open_stream

from .asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    id_header,
    kill_on_disconnect,
    read_body,
    request_identity,
    send_json,
)
from .errors import (
    at_capacity_body,
    body_too_large_body,
    describe_failure,
    draining_body,
    invalid_request_body,
    method_not_allowed_body,
    shut_down_body,
    unknown_model_body,
    unknown_path_body,
)
from .events import OpenAIEvent, aggregate_chat, aggregate_completion
from .guard import Guard, timeout_error_body, unauthorized_body
from .metrics import CONTENT_TYPE, ServerMetrics
from .preprocessor import OpenAIRequest
from .protocol import ChatCompletionRequest, parse_chat_request, parse_completion_request
from .request_span import (
    finish_request,
    record_first_token,
    record_request,
    record_usage,
    start_request,
)
from .sse import is_visible
from .sse_writer import CLIENT_GONE, WriteFailed, stream_response

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from pipeline import Engine
    from pipeline.tracing import Span, Tracer

    #: a handler of GET paths the API does not serve: the status it answered with, or
    #: None when the path is not its either (a 404 follows)
    Pages = Callable[[Scope, Receive, Send], Awaitable[int | None]]

__all__ = (
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "MAX_BODY_BYTES",
    "OpenAIApp",
)

logger = logging.getLogger(__name__)


CHAT_COMPLETIONS: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
#: request bodies above this size are refused with 413
MAX_BODY_BYTES: Final = 32 * 1024 * 1024

_GET_PATHS: Final = frozenset({"/v1/models", "/health", "/metrics"})


def _endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a request to ``path`` (unknown paths share one)."""
    if path == CHAT_COMPLETIONS or path == COMPLETIONS:
        return path
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return "/v1/models"
    return "other"


@final
class OpenAIApp:
    """The ASGI app: OpenAI endpoints over ``graph``, serving one model name.

    Args:
        graph: takes a validated :data:`OpenAIRequest` and yields its response's
            :mod:`~operators.edges.openai.events` (usually :func:`operators.graph.default_graph`).
        model_name: the one model served; a request naming another gets 404 (a request
            that names none is served).
        metrics: where to count (a fresh :class:`ServerMetrics`, own registry, if None).
        max_body_bytes: larger request bodies get 413.
        guard: API keys, admission control and deadlines (:class:`~.guard.Guard`; none of
            them by default).
        tracer: traces every generation request (None: none is traced, nothing is done).
        pages: answers the GET and HEAD paths the API does not know (the web UI), before
            they become 404s.
    """

    def __init__(
        self,
        graph: Engine[OpenAIRequest, OpenAIEvent],
        *,
        model_name: str,
        metrics: ServerMetrics | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        guard: Guard | None = None,
        tracer: Tracer | None = None,
        pages: Pages | None = None,
    ) -> None:
        self._graph = graph
        #: what traces the requests (None: untraced)
        self.tracer = tracer
        #: what answers the GET paths the API does not (the web UI), or None
        self.pages = pages
        self._guard = guard if guard is not None else Guard()
        #: in-flight requests ended by :meth:`abort` (they get a 503 error, not a 499)
        self._aborted: set[Context[Any]] = set()
        self._model_name = model_name
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._max_body_bytes = max_body_bytes
        self._created = int(time.time())
        self._contexts: set[Context[Any]] = set()
        self._draining = False
        self._model_card = {
            "id": model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "llm-pipeline",
        }

    @property
    def model_name(self) -> str:
        """The model this app serves."""
        return self._model_name

    @property
    def guard(self) -> Guard:
        """The API keys, admission control and deadlines this app applies."""
        return self._guard

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` was called."""
        return self._draining

    @property
    def inflight(self) -> int:
        """Generation requests running now."""
        return len(self._contexts)

    def drain(self) -> None:
        """Refuse new generation requests (503); the in-flight ones run on to their end.

        Shutdown calls this first and, if requests are still running after the drain
        timeout, :meth:`abort`: a stream is never cut short with a finish it did not earn.
        """
        self._draining = True

    def abort(self) -> None:
        """End every in-flight generation request now, down to the engine: a stream ends
        with an error event (503 ``service_unavailable_error``) and no ``[DONE]``, a
        non-streamed request gets a 503 body."""
        for ctx in list(self._contexts):
            self._aborted.add(ctx)
            ctx.kill()

    # ------------------------------------------------------------------------ dispatch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        if scope["type"] != "http":  # no lifespan: the runner serves with lifespan="off"
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if self._guard.requires_key and path.startswith("/v1/"):
            allowed, presented = self._guard.check_key(scope)
            if not allowed:
                await send_json(
                    send, 401, unauthorized_body(presented), ((b"www-authenticate", b"Bearer"),)
                )
                self.metrics.rejected.labels("invalid_api_key").inc()
                self.metrics.count_request(_endpoint_label(path), 401)
                return
        if path == CHAT_COMPLETIONS or path == COMPLETIONS:
            if method == "POST":
                await self._generate(path, scope, receive, send)
                return
            status = await self._method_not_allowed(send, path, "POST")
        elif method not in ("GET", "HEAD") and (
            path in _GET_PATHS or path.startswith("/v1/models/")
        ):
            status = await self._method_not_allowed(send, path, "GET")
        elif path == "/v1/models" or path.startswith("/v1/models/"):
            status = await self._models(path, send)
            path = "/v1/models"
        elif path == "/health":
            status = 503 if self._draining else 200
            body = b'{"status":"draining"}' if self._draining else b'{"status":"ok"}'
            await send_json(send, status, body)
        elif path == "/metrics":
            body = self.metrics.render()
            headers = [
                (b"content-type", CONTENT_TYPE.encode()),
                (b"content-length", b"%d" % len(body)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            status = 200
        else:
            found = None
            if self.pages is not None and method in ("GET", "HEAD"):
                found = await self.pages(scope, receive, send)
            if found is None:
                await send_json(send, 404, unknown_path_body(path))
                status = 404
            else:
                status = found
            path = "other"  # a label per unknown path would let clients grow the registry
        self.metrics.count_request(path, status)

    async def _method_not_allowed(self, send: Send, path: str, allowed: str) -> int:
        body = method_not_allowed_body(path, allowed)
        await send_json(send, 405, body, ((b"allow", allowed.encode()),))
        return 405

    async def _models(self, path: str, send: Send) -> int:
        if path == "/v1/models":
            body = orjson.dumps({"object": "list", "data": [self._model_card]})
            await send_json(send, 200, body)
            return 200
        name = path.removeprefix("/v1/models/")
        if name == self._model_name:
            await send_json(send, 200, orjson.dumps(self._model_card))
            return 200
        await send_json(send, 404, unknown_model_body(name, self._model_name))
        return 404

    # ---------------------------------------------------------------------- generation

    async def _generate(self, endpoint: str, scope: Scope, receive: Receive, send: Send) -> None:
        started = perf_counter()
        metrics = self.metrics
        metrics.inflight.inc()
        status = 500
        tracer = self.tracer
        span = None if tracer is None else start_request(tracer, scope, endpoint)
        error: BaseException | None = None
        try:
            status = await self._serve_generation(endpoint, scope, receive, send, started, span)
        except BaseException as exc:
            error = exc
            raise
        finally:
            metrics.inflight.dec()
            metrics.count_request(endpoint, status)
            metrics.request_duration.observe(perf_counter() - started)
            if span is not None:
                finish_request(span, status, error)

    async def _serve_generation(
        self,
        endpoint: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        started: float,
        span: Span | None,
    ) -> int:
        try:
            body = await read_body(receive, self._max_body_bytes)
        except BodyTooLarge:
            await send_json(send, 413, body_too_large_body(self._max_body_bytes))
            return 413
        if body is None:
            return CLIENT_GONE
        request: OpenAIRequest
        try:
            if endpoint == CHAT_COMPLETIONS:
                request = parse_chat_request(body)
            else:
                request = parse_completion_request(body)
        except InvalidRequest as exc:
            await send_json(send, 400, invalid_request_body(exc))
            return 400
        if request.model is not None and request.model != self._model_name:
            await send_json(send, 404, unknown_model_body(request.model, self._model_name))
            return 404
        if self._draining:
            await send_json(send, 503, draining_body())
            self.metrics.rejected.labels("draining").inc()
            return 503
        limit = self._guard.max_inflight
        if limit is not None and len(self._contexts) >= limit:
            await send_json(send, 503, at_capacity_body(limit), ((b"retry-after", b"1"),))
            self.metrics.rejected.labels("max_inflight").inc()
            return 503
        try:
            request_id, metadata = request_identity(scope)
            if request_id is not None and any(c.id == request_id for c in self._contexts):
                raise InvalidRequest(
                    f"a request with x-request-id {request_id!r} is already in flight",
                    param="x-request-id",
                )
        except InvalidRequest as exc:
            await send_json(send, 400, invalid_request_body(exc))
            return 400
        time_limit = self._guard.timeout_for(scope, stream=request.stream)
        ctx = Context.new(
            request,
            id=request_id,
            metadata=metadata,
            deadline=None if time_limit is None else anyio.current_time() + time_limit,
            span=span if self.tracer is not None and self.tracer.stages else None,
        )
        if span is not None:
            record_request(span, request, ctx.id, self._model_name)
        self._contexts.add(ctx)
        status = CLIENT_GONE
        failed: BaseException | None = None
        try:
            async with anyio.create_task_group() as watcher:
                watcher.start_soon(kill_on_disconnect, receive, ctx)
                try:
                    if request.stream:
                        status = await stream_response(
                            self._graph,
                            ctx,
                            send,
                            started=started,
                            include_usage=request.include_usage,
                            metrics=self.metrics,
                            ended_by_server=lambda ctx: self._ended_by_server(ctx, time_limit),
                            span=span,
                        )
                    else:
                        status = await self._complete(ctx, send, time_limit, span, started)
                except WriteFailed as exc:
                    failed = exc.__cause__  # re-raised below, not as part of a task group's
                finally:
                    watcher.cancel_scope.cancel()
        finally:
            self._contexts.discard(ctx)
            self._aborted.discard(ctx)
        if failed is not None:
            raise failed
        return status

    def _ended_by_server(
        self, ctx: Context[Any], time_limit: float | None
    ) -> tuple[int, bytes] | None:
        """Why a killed request was killed, if the server did it: (status, error body);
        None when the client went away."""
        if ctx in self._aborted:
            return 503, shut_down_body()
        deadline = ctx.deadline
        if time_limit is not None and deadline is not None and anyio.current_time() >= deadline:
            self.metrics.timed_out.inc()
            return 504, timeout_error_body(time_limit)
        return None

    async def _complete(
        self,
        ctx: Context[OpenAIRequest],
        send: Send,
        time_limit: float | None,
        span: Span | None = None,
        started: float = 0.0,
    ) -> int:
        """Run the graph to the end and send the aggregated response as one JSON body."""
        try:
            async with open_stream(self._graph, ctx) as stream:
                if span is None:
                    events = [event async for event in stream]
                else:
                    events = await _collect_traced(stream, span, started)
            if ctx.is_killed:
                return await self._send_kill(ctx, send, time_limit)
            if isinstance(ctx.data, ChatCompletionRequest):
                response = aggregate_chat(events)
            else:
                response = aggregate_completion(events)
        except Exception as exc:
            if ctx.is_killed:
                return await self._send_kill(ctx, send, time_limit)
            status, body = describe_failure(exc, ctx.id)
            await send_json(send, status, body, id_header(ctx))
            return status
        usage = response["usage"]
        if usage is not None:
            self.metrics.output_tokens.inc(usage["completion_tokens"])
            if span is not None:
                reasons = [c["finish_reason"] for c in response["choices"] if c["finish_reason"]]
                record_usage(span, usage, reasons)
        await send_json(send, 200, orjson.dumps(response), id_header(ctx))
        return 200

    async def _send_kill(self, ctx: Context[Any], send: Send, time_limit: float | None) -> int:
        ended = self._ended_by_server(ctx, time_limit)
        if ended is None:
            return CLIENT_GONE
        status, body = ended
        await send_json(send, status, body, id_header(ctx))
        return status


async def _collect_traced(
    stream: AsyncIterator[OpenAIEvent], span: Span, started: float
) -> list[OpenAIEvent]:
    """A non-streamed response's events, noting on ``span`` when the first text came."""
    events: list[OpenAIEvent] = []
    seen = False
    async for event in stream:
        events.append(event)
        if not seen and is_visible(event):
            seen = True
            record_first_token(span, started)
    return events
