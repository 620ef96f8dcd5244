"""The ASGI app every edge is served by: :class:`EdgeApp`, one port, many models, many APIs.

::

    request --> CORS (an allowed Origin: its headers; a preflight: 204)
            --> route (exact path, else a {name} template) --> API key (guarded routes):
                its Tenant (call.tenant: its name, limits, models)
            --> a JSON route's body must say content-type: application/json (else 415)
            --> a metered route: admitted on its key's limits (429), settled after
            --> the edge's handler --> its model (app.models) --> that model's graph
            --> llm_pipeline_requests_total{endpoint, status, model}
    GET /live, /ready, /health, /metrics: the app's own, never guarded (:mod:`.probes`)
    GET /v1/usage: each key's usage (:mod:`.usage`)

The app knows no API and routes every API by model the same way (:mod:`.models`: each
model its own graph; an unknown model is a 404 in the edge's words). Each
:class:`~.routes.Edge` brings its routes and the
:class:`~.failures.ErrorStyle` they answer in (OpenAI's, Anthropic's), and hands generation
requests to :class:`~.generation.Generations`, which owns admission, deadlines, request
ids, disconnects and the drain for all of them. :class:`operators.edges.openai.server.
OpenAIApp` is this app with the OpenAI edge; ``build_app`` adds the Responses and
Anthropic edges beside it.

Why it is raw ASGI and not a framework's router: the per-token path is "render the event to
bytes once, buffer it, write" (:mod:`.sse_writer`); dispatch is one dict lookup.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar, TypeVarTuple

import anyio
import anyio.to_thread

from pipeline.health import Health

from .asgi import Receive, Scope, Send, send_json
from .cors import answer_preflight, with_cors
from .failures import (
    ClientGone,
    ErrorStyle,
    Refusal,
    method_not_allowed,
    not_json,
    unauthorized,
    unknown_path,
)
from .generation import Generations
from .guard import Guard
from .ledger import UsageLedger
from .metrics import CONTENT_TYPE, ServerMetrics
from .models import Models, ServedModel
from .probes import PROBES, HealthMetrics, health_answer, live_answer, ready_answer
from .routes import Call, Edge, Prepare, Route
from .schema import OFF_LOOP_BYTES
from .sse_writer import CLIENT_GONE
from .tenants import ANONYMOUS, Tenant
from .usage import usage_routes

if TYPE_CHECKING:
    from pipeline import Engine
    from pipeline.tracing import Tracer

__all__ = ("MAX_BODY_BYTES", "EdgeApp", "Pages")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: request bodies above this size are refused with 413
MAX_BODY_BYTES: Final = 32 * 1024 * 1024
#: the app's own paths, never guarded
_OWN_PATHS: Final = PROBES | {"/metrics"}
#: methods whose body a JSON route reads
_WITH_BODY: Final = frozenset({"POST", "PUT", "PATCH"})

Pages: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[int | None]]
"""A handler of the GET paths no edge serves (the web UI): the status it answered with, or
None when the path is not its either (a 404 follows)."""


class _Methods(dict[str, Route]):
    """The routes of one path, by method (HEAD answered as GET)."""

    def allowed(self) -> str:
        return ", ".join(sorted(self))


class EdgeApp:
    """The ASGI app: ``edges`` over the graphs of ``models``.

    Args:
        graph: what generation requests run on (usually the default graph), for an app of
            one model, ``model_name``; or None, with ``models``.
        model_name: that one model's name.
        models: the models served, each with its graph (:mod:`.models`); may change while
            the app serves (``app.models``).
        edges: the APIs served, in order; a path claimed twice keeps its first route.
        errors: how the app says "unknown path" (and 401 there).
        metrics: where to count (a fresh :class:`ServerMetrics`, own registry, if None).
        max_body_bytes: larger request bodies get 413.
        guard: API keys, admission control and deadlines (none of them by default).
        tracer: traces every generation request (None: none is traced, nothing is done).
        pages: answers the GET and HEAD paths no edge serves (the web UI), before they
            become 404s.
        health: what ``/live``, ``/ready`` and ``/health`` tell, and what refuses a
            request at once when no engine of its model can answer (a fresh
            :class:`~pipeline.health.Health` if None: every model ready).
    """

    def __init__(
        self,
        graph: Engine[Any, Any] | None = None,
        *,
        model_name: str | None = None,
        models: Models | Iterable[ServedModel] | None = None,
        edges: Iterable[Edge],
        errors: ErrorStyle,
        metrics: ServerMetrics | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        guard: Guard | None = None,
        tracer: Tracer | None = None,
        pages: Pages | None = None,
        health: Health | None = None,
    ) -> None:
        self._models = _models(graph, model_name, models)
        #: the engines' and workers' health, by model (:mod:`pipeline.health`)
        self.health = health if health is not None else Health()
        self._errors = errors
        self._guard = guard if guard is not None else Guard()
        self.metrics = metrics if metrics is not None else ServerMetrics()
        #: what answers the GET paths no edge serves (the web UI), or None
        self.pages = pages
        #: each key's usage, by model and minute (``GET /v1/usage``)
        self.ledger = UsageLedger()
        self._generations = Generations(
            self._models,
            guard=self._guard,
            metrics=self.metrics,
            max_body_bytes=max_body_bytes,
            tracer=tracer,
            ledger=self.ledger,
            health=self.health,
        )
        try:
            self.metrics.registry.register(HealthMetrics(self.health))
        except ValueError:  # (metrics shared with an app that registered its health first)
            pass
        #: large bodies are parsed off the event loop, one at a time (created on first use)
        self._limiter: anyio.CapacityLimiter | None = None
        self._exact: dict[str, _Methods] = {}
        self._templates: list[tuple[tuple[str, ...], _Methods]] = []
        for edge in edges:
            for route in edge.routes(self):
                self._add(route)
        for route in usage_routes(self.ledger, errors):
            self._add(route)

    def _add(self, route: Route) -> None:
        segments = tuple(route.path.strip("/").split("/"))
        if any(segment.startswith("{") for segment in segments):
            methods = next((m for s, m in self._templates if s == segments), None)
            if methods is None:
                methods = _Methods()
                self._templates.append((segments, methods))
        else:
            methods = self._exact.setdefault(route.path, _Methods())
        for method in route.methods:
            methods.setdefault(method, route)

    # ------------------------------------------------------------------ the Host protocol

    @property
    def models(self) -> Models:
        """The models served, each with its graph; add and remove them while serving."""
        return self._models

    @property
    def graph(self) -> Engine[Any, Any]:
        """The default model's graph (what a request naming no model runs on).

        Raises:
            LookupError: no model is served now.
        """
        default = self._models.default
        if default is None:
            raise LookupError("no model is served now")
        return default.graph

    @property
    def model_name(self) -> str:
        """The default model's name ("" while none is served)."""
        default = self._models.default
        return "" if default is None else default.name

    @property
    def errors(self) -> ErrorStyle:
        """How the app itself says what went wrong (unknown paths, a 431)."""
        return self._errors

    @property
    def generations(self) -> Generations:
        """The generation requests in flight and the rules they run under."""
        return self._generations

    async def generate(
        self, call: Call, prepare: Prepare, errors: ErrorStyle, *, route: str | None = None
    ) -> int:
        """Serve ``call`` as a generation request (:meth:`.generation.Generations.run`)."""
        return await self._generations.run(call, errors, prepare, route=route)

    async def read_body(self, call: Call) -> bytes:
        """The request's body, bounded (:meth:`.generation.Generations.read_body`)."""
        return await self._generations.read_body(call)

    async def offload(self, size: int, work: Callable[[*Ts], T], *args: *Ts) -> T:
        """``work(*args)``: in a worker thread, one at a time, when ``size`` is over
        :data:`~.schema.OFF_LOOP_BYTES` (parsing 250k items takes a second of one core,
        which must not stall the other requests), else here."""
        if size <= OFF_LOOP_BYTES:
            return work(*args)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(work, *args, limiter=self._limiter)

    @property
    def guard(self) -> Guard:
        """API keys, admission control and deadlines."""
        return self._guard

    @property
    def tracer(self) -> Tracer | None:
        """What traces the requests (None: untraced)."""
        return self._generations.tracer

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` was called."""
        return self._generations.draining

    # --------------------------------------------------------------------- the lifecycle

    @property
    def inflight(self) -> int:
        """Generation requests running now."""
        return self._generations.inflight

    def drain(self) -> None:
        """Refuse new generation requests (503); the in-flight ones run on to their end.

        Shutdown calls this first and, if requests are still running after the drain
        timeout, :meth:`abort`: a stream is never cut short with a finish it did not earn.
        """
        self._generations.drain()

    def abort(self) -> None:
        """End every in-flight generation request now, down to the engine: a stream ends
        with an error event (and no end marker), a non-streamed request gets an error body
        (503 in OpenAI's words)."""
        self._generations.abort()

    # ------------------------------------------------------------------------ dispatch

    def _match(self, path: str) -> tuple[_Methods, dict[str, str]] | None:
        methods = self._exact.get(path)
        if methods is not None:
            return methods, {}
        segments = path.strip("/").split("/")
        for template, candidates in self._templates:
            if len(template) != len(segments):
                continue
            params: dict[str, str] = {}
            for expected, segment in zip(template, segments, strict=True):
                if expected.startswith("{"):
                    if not segment:
                        break
                    params[expected[1:-1]] = segment
                elif expected != segment:
                    break
            else:
                return candidates, params
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        if scope["type"] != "http":  # no lifespan: the runner serves with lifespan="off"
            return
        path: str = scope["path"]
        method: str = scope["method"]
        origin, content_type, preflight = _headers(scope)
        if origin is not None and self._guard.cors and self._guard.origin_allowed(origin):
            if method == "OPTIONS" and preflight is not None:
                await answer_preflight(send, origin, scope)
                self.metrics.count_request("other", 204)
                return
            send = with_cors(send, origin)
        if path in _OWN_PATHS:
            await self._own(path, method, send)
            return
        found = self._match(path)
        if found is None:
            if path.startswith("/v1/") and await self._admitted(scope, send, self._errors) is None:
                self.metrics.count_request("other", 401)
                return
            answered = None
            if self.pages is not None and method in ("GET", "HEAD"):
                answered = await self.pages(scope, receive, send)
            if answered is None:
                rendered = self._errors.render(unknown_path(path))
                await send_json(send, rendered.status, rendered.body, rendered.headers)
                answered = rendered.status
            # a label per unknown path would let clients grow the registry
            self.metrics.count_request("other", answered)
            return
        methods, params = found
        route = methods.get("GET" if method == "HEAD" else method)
        any_route = route if route is not None else next(iter(methods.values()))
        tenant = ANONYMOUS
        if any_route.guarded:
            found_tenant = await self._admitted(scope, send, any_route.errors)
            if found_tenant is None:
                self.metrics.count_request(any_route.endpoint, 401)
                return
            tenant = found_tenant
        if route is None:
            error = method_not_allowed(path, methods.allowed())
            rendered = any_route.errors.render(error)
            await send_json(send, rendered.status, rendered.body, rendered.headers)
            self.metrics.count_request(any_route.endpoint, rendered.status)
            return
        if route.json and method in _WITH_BODY and not _is_json(content_type):
            rendered = route.errors.render(not_json(_text(content_type)))
            await send_json(send, rendered.status, rendered.body, rendered.headers)
            self.metrics.count_request(route.endpoint, rendered.status)
            return
        owner = self._guard.owner(scope) if self._guard.requires_key else ""
        call = Call(scope, receive, send, params, owner, tenant=tenant)
        if route.metered:
            status = await self._metered(route, call)
        else:
            try:
                status = await route.handler(call)
            except ClientGone:
                status = CLIENT_GONE
        self.metrics.count_request(route.endpoint, status, call.model)

    async def _metered(self, route: Route, call: Call) -> int:
        """Serve ``call`` on a metered route: admitted on its key's limits first (a 429 in
        the route's words), settled once the handler answered."""
        try:
            ticket = await self._generations.admission.enter(call.tenant, call.receive)
        except Refusal as exc:
            rendered = route.errors.render(exc.error)
            await send_json(call.send, rendered.status, rendered.body, rendered.headers)
            return rendered.status
        call.ticket = ticket
        status = 500
        try:
            status = await route.handler(call)
        except ClientGone:
            status = CLIENT_GONE
        finally:
            ticket.model = call.model
            await ticket.settle(status)
        return status

    async def _admitted(self, scope: Scope, send: Send, errors: ErrorStyle) -> Tenant | None:
        """The request's tenant (no keys: :data:`~.tenants.ANONYMOUS`); None, after a 401,
        when it presented no valid key."""
        tenant, presented = self._guard.identify(scope)
        if tenant is not None:
            return tenant
        rendered = errors.render(unauthorized(presented))
        await send_json(send, rendered.status, rendered.body, rendered.headers)
        self.metrics.rejected.labels("invalid_api_key").inc()
        return None

    async def _own(self, path: str, method: str, send: Send) -> None:
        """The probes and ``/metrics``: open to orchestrators and scrapers, GET only."""
        if method not in ("GET", "HEAD"):
            rendered = self._errors.render(method_not_allowed(path, "GET"))
            await send_json(send, rendered.status, rendered.body, rendered.headers)
            self.metrics.count_request(path, rendered.status)
            return
        if path in PROBES:
            draining = self._generations.draining
            if path == "/live":
                status, body = live_answer(self.health)
            elif path == "/ready":
                status, body = ready_answer(self.health, self._models, draining=draining)
            else:
                status, body = health_answer(self.health, draining=draining)
            await send_json(send, status, body)
        else:
            body = self.metrics.render()
            headers = [
                (b"content-type", CONTENT_TYPE.encode()),
                (b"content-length", b"%d" % len(body)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            status = 200
        self.metrics.count_request(path, status)


def _headers(scope: Scope) -> tuple[bytes | None, bytes | None, bytes | None]:
    """The request's ``Origin``, ``Content-Type`` and ``Access-Control-Request-Method``."""
    origin = content_type = preflight = None
    for name, value in scope.get("headers", ()):
        if name == b"origin":
            origin = value
        elif name == b"content-type":
            content_type = value
        elif name == b"access-control-request-method":
            preflight = value
    return origin, content_type, preflight


def _is_json(content_type: bytes | None) -> bool:
    """``application/json``, with or without parameters (``; charset=utf-8``)."""
    if content_type is None:
        return False
    return content_type.partition(b";")[0].strip().lower() == b"application/json"


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")[:100]


def _models(
    graph: Engine[Any, Any] | None,
    model_name: str | None,
    models: Models | Iterable[ServedModel] | None,
) -> Models:
    """The app's models: ``models``, or the one ``graph`` serving ``model_name``.

    Raises:
        TypeError: neither, or both, were given.
    """
    if models is not None:
        if graph is not None:
            raise TypeError("give either graph (with model_name) or models, not both")
        return models if isinstance(models, Models) else Models(models)
    if graph is None or model_name is None:
        raise TypeError("give graph and model_name, or models")
    return Models([ServedModel(name=model_name, graph=graph)])
