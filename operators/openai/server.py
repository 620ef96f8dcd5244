"""The OpenAI-compatible HTTP edge: :class:`OpenAIApp`, a raw ASGI app over a serving graph.

The app does not care what is inside the graph: it parses a request body into a protocol
model, runs ``graph.generate(ctx)`` under :func:`pipeline.open_stream`, and writes the
OpenAI chunk dicts the graph yields, either as server-sent events or, aggregated, as one
JSON response::

    POST /v1/chat/completions   ChatCompletionRequest --[graph]--> chat.completion.chunk dicts
    POST /v1/completions        CompletionRequest     --[graph]--> text_completion dicts
    GET  /v1/models, /v1/models/{model}, /health, /metrics

This is the one place where exceptions become HTTP errors, all OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``)::

    InvalidRequest (bad JSON, bad UTF-8, bad field)  400 invalid_request_error, param
    a model other than the served one                404 invalid_request_error, model_not_found
    CapacityExhausted, WorkerLost, shutting down     503 service_unavailable_error
    EngineError, RequestError                        500 server_error, the error's message
    anything else                                    500 server_error, a generic message (logged)

An error after a stream has started is sent as one ``data: {"error": {...}}`` event, and
the stream then closes *without* ``data: [DONE]`` (as OpenAI does), so a client can tell a
failed stream from a finished one.

Why it is raw ASGI and not a framework route: the per-token path is "dump a dict with
orjson, frame it, write it". Chunks that carry no visible text (the chat role preamble,
finish-only and usage chunks) are held and written together with the next one, so the
role chunk travels with the first token and the finish chunk, usage and ``[DONE]`` leave
in one write. HTTP headers are sent only with the first visible token (or at the end), so
an error before any output still gets its proper status code. The usage chunk doubles as
the server's token count: streams always ask the graph for it, and it is dropped from the
response when the client did not ask for it.

A client that disconnects kills its request down to the engine (``ctx.kill()``), noticed
by a watcher task waiting on ``http.disconnect``. :meth:`OpenAIApp.drain` stops every
in-flight request gracefully for shutdown: streams end with a finish reason and ``[DONE]``.
:mod:`operators.openai.runner` serves the app with uvicorn; :mod:`.metrics` has the series.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final, TypeAlias, final

import anyio
import orjson

from pipeline import (
    CapacityExhausted,
    Context,
    EngineError,
    InvalidRequest,
    RequestError,
    WorkerLost,
    open_stream,
)

from .metrics import CONTENT_TYPE, ServerMetrics
from .preprocessor import OpenAIRequest, aggregate_chat, aggregate_completion
from .protocol import (
    ChatCompletionRequest,
    StreamOptions,
    parse_chat_request,
    parse_completion_request,
)

if TYPE_CHECKING:
    from pipeline import Engine

__all__ = (
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "MAX_BODY_BYTES",
    "OpenAIApp",
)

logger = logging.getLogger(__name__)

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]

_Chunk: TypeAlias = dict[str, Any]

CHAT_COMPLETIONS: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
#: request bodies above this size are refused with 413
MAX_BODY_BYTES: Final = 32 * 1024 * 1024

_CLIENT_GONE: Final = 499  # nginx's "client closed request", for the metrics label
_DONE: Final = b"data: [DONE]\n\n"
_JSON: Final = (b"content-type", b"application/json")
_SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)
_GET_PATHS: Final = frozenset({"/v1/models", "/health", "/metrics"})
_INTERNAL_MESSAGE: Final = "The server had an error while processing your request."
_WITH_USAGE: Final = StreamOptions(include_usage=True)


class _BodyTooLarge(Exception):
    pass


def _error_body(
    message: str, type_: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def _describe_failure(exc: Exception, request_id: str) -> tuple[int, bytes]:
    """The HTTP status and OpenAI error body for an exception a request raised."""
    if isinstance(exc, InvalidRequest):
        return 400, _error_body(exc.message, "invalid_request_error", param=exc.param)
    if isinstance(exc, CapacityExhausted | WorkerLost):
        logger.info("request %s: %s: %s", request_id, type(exc).__name__, exc)
        return 503, _error_body(exc.message, "service_unavailable_error")
    if isinstance(exc, EngineError | RequestError):
        logger.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        return 500, _error_body(exc.message, "server_error")
    logger.error("request %s failed unexpectedly", request_id, exc_info=exc)
    return 500, _error_body(f"{_INTERNAL_MESSAGE} (request id {request_id})", "server_error")


def _is_held(chunk: _Chunk) -> bool:
    """True for a chunk with no visible text in its first choice, or one that finishes it.

    Such chunks are written together with the next one (or the end of the stream): they
    add nothing a client could show, and are usually followed at once by more.
    """
    choices = chunk.get("choices")
    if not choices:
        return True  # usage
    choice = choices[0]
    if choice.get("finish_reason") is not None:
        return True
    delta = choice.get("delta")
    if delta is not None:
        return not delta.get("content") and not delta.get("tool_calls")
    return not choice.get("text")


def _completion_tokens(response: _Chunk) -> int:
    usage = response.get("usage")
    if not usage:
        return 0
    tokens = usage.get("completion_tokens")
    return tokens if isinstance(tokens, int) else 0


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise _BodyTooLarge
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise _BodyTooLarge
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _kill_on_disconnect(receive: Receive, ctx: Context[Any]) -> None:
    """Kill ``ctx`` when the client disconnects; cancelled once the response is complete."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ctx.kill()
            return


async def _send_json(
    send: Send, status: int, body: bytes, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", b"%d" % len(body)), *extra_headers],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


@final
class OpenAIApp:
    """The ASGI app: OpenAI endpoints over ``graph``, serving one model name.

    Args:
        graph: takes a validated :data:`OpenAIRequest` and yields OpenAI chunk dicts
            (usually :func:`operators.graph.default_graph`).
        model_name: the one model served; a request naming another gets 404 (a request
            that names none is served).
        metrics: where to count (a fresh :class:`ServerMetrics`, own registry, if None).
        max_body_bytes: larger request bodies get 413.
    """

    def __init__(
        self,
        graph: Engine[OpenAIRequest, _Chunk],
        *,
        model_name: str,
        metrics: ServerMetrics | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self._graph = graph
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
    def inflight(self) -> int:
        """Generation requests running now."""
        return len(self._contexts)

    def drain(self) -> None:
        """Refuse new generation requests (503) and gracefully stop the in-flight ones."""
        self._draining = True
        for ctx in list(self._contexts):
            ctx.stop_generating()

    # ------------------------------------------------------------------------ dispatch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        kind = scope["type"]
        if kind != "http":
            if kind == "lifespan":
                await self._lifespan(receive, send)
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path == CHAT_COMPLETIONS or path == COMPLETIONS:
            if method == "POST":
                await self._generate(path, receive, send)
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
            await _send_json(send, status, body)
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
            body = _error_body(f"Unknown path {path!r}.", "invalid_request_error")
            await _send_json(send, 404, body)
            status = 404
            path = "other"  # a label per unknown path would let clients grow the registry
        self.metrics.count_request(path, status)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.drain()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _method_not_allowed(self, send: Send, path: str, allowed: str) -> int:
        body = _error_body(f"{path} only accepts {allowed}.", "invalid_request_error")
        await _send_json(send, 405, body, ((b"allow", allowed.encode()),))
        return 405

    async def _models(self, path: str, send: Send) -> int:
        if path == "/v1/models":
            body = orjson.dumps({"object": "list", "data": [self._model_card]})
            await _send_json(send, 200, body)
            return 200
        name = path.removeprefix("/v1/models/")
        if name == self._model_name:
            await _send_json(send, 200, orjson.dumps(self._model_card))
            return 200
        await _send_json(send, 404, self._unknown_model(name))
        return 404

    def _unknown_model(self, name: str) -> bytes:
        return _error_body(
            f"The model {name!r} does not exist; this server serves {self._model_name!r}.",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )

    # ---------------------------------------------------------------------- generation

    async def _generate(self, endpoint: str, receive: Receive, send: Send) -> None:
        started = perf_counter()
        metrics = self.metrics
        metrics.inflight.inc()
        status = 500
        try:
            status = await self._serve_generation(endpoint, receive, send, started)
        finally:
            metrics.inflight.dec()
            metrics.count_request(endpoint, status)
            metrics.request_duration.observe(perf_counter() - started)

    async def _serve_generation(
        self, endpoint: str, receive: Receive, send: Send, started: float
    ) -> int:
        try:
            body = await _read_body(receive, self._max_body_bytes)
        except _BodyTooLarge:
            message = f"The request body exceeds {self._max_body_bytes} bytes."
            await _send_json(send, 413, _error_body(message, "invalid_request_error"))
            return 413
        if body is None:
            return _CLIENT_GONE
        request: OpenAIRequest
        try:
            if endpoint == CHAT_COMPLETIONS:
                request = parse_chat_request(body)
            else:
                request = parse_completion_request(body)
        except InvalidRequest as exc:
            await _send_json(
                send, 400, _error_body(exc.message, "invalid_request_error", param=exc.param)
            )
            return 400
        if request.model is not None and request.model != self._model_name:
            await _send_json(send, 404, self._unknown_model(request.model))
            return 404
        if self._draining:
            body = _error_body("The server is shutting down.", "service_unavailable_error")
            await _send_json(send, 503, body)
            return 503
        # The usage chunk is the server's token count too: a stream asks for it always,
        # and it is stripped from the response when the client did not ask for it.
        strip_usage = request.stream and not request.include_usage
        if strip_usage:
            request = request.model_copy(update={"stream_options": _WITH_USAGE})
        ctx = Context.new(request)
        self._contexts.add(ctx)
        status = _CLIENT_GONE
        try:
            async with anyio.create_task_group() as watcher:
                watcher.start_soon(_kill_on_disconnect, receive, ctx)
                try:
                    if request.stream:
                        status = await self._stream(ctx, send, started, strip_usage)
                    else:
                        status = await self._complete(ctx, send)
                finally:
                    watcher.cancel_scope.cancel()
        finally:
            self._contexts.discard(ctx)
        return status

    async def _complete(self, ctx: Context[OpenAIRequest], send: Send) -> int:
        """Run the graph to the end and send the aggregated response as one JSON body."""
        chunks: list[_Chunk] = []
        try:
            async with open_stream(self._graph, ctx) as stream:
                chunks.extend([chunk async for chunk in stream])
            if ctx.is_killed:
                return _CLIENT_GONE
            if isinstance(ctx.data, ChatCompletionRequest):
                response = aggregate_chat(chunks)
            else:
                response = aggregate_completion(chunks)
        except Exception as exc:
            if ctx.is_killed:
                return _CLIENT_GONE
            status, body = _describe_failure(exc, ctx.id)
            await _send_json(send, status, body)
            return status
        self.metrics.output_tokens.inc(_completion_tokens(response))
        await _send_json(send, 200, orjson.dumps(response))
        return 200

    async def _stream(
        self, ctx: Context[OpenAIRequest], send: Send, started: float, strip_usage: bool
    ) -> int:
        """Stream the graph's chunks as server-sent events."""
        metrics = self.metrics
        observe_itl = metrics.inter_token_latency.observe
        dumps = orjson.dumps
        held: list[bytes] = []
        headers_sent = False
        last_write = 0.0
        tokens = 0
        try:
            async with open_stream(self._graph, ctx) as stream:
                async for chunk in stream:
                    if _is_held(chunk):
                        if not chunk.get("choices"):
                            tokens = _completion_tokens(chunk)
                            if strip_usage:
                                continue
                        elif strip_usage:
                            chunk.pop("usage", None)
                        held.append(b"data: " + dumps(chunk) + b"\n\n")
                        continue
                    if strip_usage:
                        chunk.pop("usage", None)
                    data = b"data: " + dumps(chunk) + b"\n\n"
                    if held:
                        held.append(data)
                        data = b"".join(held)
                        held.clear()
                    if not headers_sent:
                        await send(self._stream_start(ctx))
                        headers_sent = True
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                        last_write = perf_counter()
                        metrics.time_to_first_token.observe(last_write - started)
                        continue
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    now = perf_counter()
                    observe_itl(now - last_write)
                    last_write = now
        except Exception as exc:
            if ctx.is_killed:
                return _CLIENT_GONE
            status, body = _describe_failure(exc, ctx.id)
            if not headers_sent:
                await _send_json(send, status, body)
                return status
            held.append(b"data: " + body + b"\n\n")
            await send({"type": "http.response.body", "body": b"".join(held), "more_body": False})
            return status
        finally:
            if tokens:
                metrics.output_tokens.inc(tokens)
        if ctx.is_killed:
            return _CLIENT_GONE
        if not headers_sent:
            await send(self._stream_start(ctx))
        held.append(_DONE)
        await send({"type": "http.response.body", "body": b"".join(held), "more_body": False})
        return 200

    @staticmethod
    def _stream_start(ctx: Context[Any]) -> Message:
        return {
            "type": "http.response.start",
            "status": 200,
            "headers": [*_SSE_HEADERS, (b"x-request-id", ctx.id.encode())],
        }
