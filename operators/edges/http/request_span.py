"""The span of one generation request at the HTTP edge: HTTP and GenAI conventions.

:class:`~.generation.Generations` starts it when a generation request arrives, through any
edge (a child of the client's span when it sent a W3C ``traceparent``), puts it in the
request's Context so that the graph's stages hang under it, and ends it with the
response's status. What it records, with OpenTelemetry's attribute names:

* HTTP: ``http.request.method``, ``http.route``, ``url.path``, ``url.scheme``,
  ``client.address``, ``user_agent.original``, ``http.response.status_code``,
  ``error.type`` (a 5xx);
* GenAI: ``gen_ai.operation.name`` (``text_completion`` for completions, ``chat`` for
  chat completions, Responses and Messages),
  ``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``temperature``, ``top_p``,
  ``gen_ai.request.stream``, ``gen_ai.response.model``, ``gen_ai.response.id``,
  ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
  ``gen_ai.usage.cache_read.input_tokens`` (when the engine reported its cache),
  ``gen_ai.response.finish_reasons``, ``gen_ai.response.time_to_first_chunk``;
* ``llm_pipeline.request.owner``, when the server has API keys: who the request acted
  for (:meth:`~.guard.Guard.owner`, a salted digest of its key, never the key), so that
  the status view shows each key only its own requests;
* ``llm_pipeline.request.key``: the name of its API key (never the key), and
  ``llm_pipeline.admission.arrival`` and ``.order``: where its arrival and its admission
  fall in this frontend's numbering of admission events (the fair queue's order);
* ``llm_pipeline.request.id`` (the ``x-request-id``), and the events ``first_token``
  (the first text written) and ``finish`` (the finish reasons).

Nothing here runs per token: the first token and the usage are moments the server
already singles out.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from pipeline.tracing import Span, Tracer

    from .asgi import Scope

__all__ = (
    "REQUEST_ID",
    "REQUEST_KEY",
    "REQUEST_OWNER",
    "finish_request",
    "record_admission",
    "record_first_token",
    "record_request",
    "record_usage",
    "start_request",
)

#: the attribute holding the request's id (its ``x-request-id``)
REQUEST_ID: Final = "llm_pipeline.request.id"
#: the attribute naming who the request acted for (an owner digest; absent without keys)
REQUEST_OWNER: Final = "llm_pipeline.request.owner"
#: the attribute naming the request's API key by its name (absent without keys)
REQUEST_KEY: Final = "llm_pipeline.request.key"
_OPERATIONS: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def start_request(tracer: Tracer, scope: Scope, route: str, *, owner: str = "") -> Span:
    """The span of a request to ``route`` (``POST /v1/chat/completions``), joining the
    trace of the client's ``traceparent`` header when it sent a valid one; ``owner``: who
    it acts for ("" : the server has no keys)."""
    method = scope.get("method", "POST")
    span = tracer.start(f"{method} {route}", traceparent=_header(scope, b"traceparent"))
    span.set("http.request.method", method)
    span.set("http.route", route)
    span.set("url.path", scope.get("path", route))
    span.set("url.scheme", scope.get("scheme", "http"))
    if owner:
        span.set(REQUEST_OWNER, owner)
    client = scope.get("client")
    if client:
        span.set("client.address", str(client[0]))
    agent = _header(scope, b"user-agent")
    if agent is not None:
        span.set("user_agent.original", agent)
    request_id = _header(scope, b"x-request-id")
    if request_id is not None:  # (a request refused before it has a Context keeps it too)
        span.set(REQUEST_ID, request_id[:128])
    operation = _OPERATIONS.get(route)
    if operation is not None:
        span.set("gen_ai.operation.name", operation)
    return span


def record_request(
    span: Span,
    request: Any,
    request_id: str,
    served: str,
    response_id: str | None = None,
    *,
    stream: bool | None = None,
) -> None:
    """What the client asked for, once the body parsed (``request``: the graph's request,
    a chat or completions request whichever the edge, or a token request; ``response_id``:
    the id the edge names its response with, when not OpenAI's ``chatcmpl-``/``cmpl-`` +
    request id; ``stream``: whether it streams, when the request does not say)."""
    span.set(REQUEST_ID, request_id)
    span.set("gen_ai.request.model", getattr(request, "model", None) or served)
    span.set("gen_ai.response.model", served)
    if stream is None:
        stream = bool(getattr(request, "stream", False))
    span.set("gen_ai.request.stream", stream)
    if response_id is None:
        completions = str(span.attributes.get("http.route")) == "/v1/completions"
        response_id = f"{'cmpl' if completions else 'chatcmpl'}-{request_id}"
    span.set("gen_ai.response.id", response_id)
    for name, attribute in (
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("seed", "gen_ai.request.seed"),
        ("n", "gen_ai.request.choice.count"),
    ):
        value: Any = getattr(request, name, None)
        if name == "max_tokens" and value is None:
            value = getattr(request, "max_completion_tokens", None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            span.set(attribute, value)
    stop = getattr(request, "stop", None)
    if isinstance(stop, str):
        span.set("gen_ai.request.stop_sequences", [stop])
    elif isinstance(stop, list) and stop:
        span.set("gen_ai.request.stop_sequences", [str(s) for s in stop])


def record_admission(span: Span, key: str, arrival: int, order: int) -> None:
    """Who the request came for (``key``: its API key's name; "" without keys), and where
    its arrival and its admission fall in the frontend's admission events."""
    if key:
        span.set(REQUEST_KEY, key)
    span.set("llm_pipeline.admission.arrival", arrival)
    span.set("llm_pipeline.admission.order", order)


def record_first_token(span: Span, started: float) -> None:
    """The first text reached the client (``started``: the request's ``perf_counter``)."""
    span.add_event("first_token")
    span.set("gen_ai.response.time_to_first_chunk", perf_counter() - started)


def record_usage(span: Span, usage: Any, finish_reasons: list[str]) -> None:
    """The response's token counts (the graph's ``Usage`` event, or OpenAI's ``usage``
    object) and its choices' finish reasons: the ``finish`` event."""
    if not isinstance(usage, dict):
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        cached = usage.cached_tokens
    else:
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    span.set("gen_ai.usage.input_tokens", prompt)
    span.set("gen_ai.usage.output_tokens", completion)
    if cached is not None:
        span.set("gen_ai.usage.cache_read.input_tokens", cached)
    span.set("gen_ai.response.finish_reasons", list(finish_reasons))
    span.add_event("finish", {"gen_ai.response.finish_reasons": list(finish_reasons)})


def finish_request(span: Span, status: int, error: BaseException | None = None) -> None:
    """End the request's span with the status the client got (499: it went away)."""
    span.set("http.response.status_code", status)
    if status >= 500:
        span.set("error.type", type(error).__name__ if error is not None else str(status))
        span.set_error(f"HTTP {status}" if error is None else f"{type(error).__name__}: {error}")
    span.end()
