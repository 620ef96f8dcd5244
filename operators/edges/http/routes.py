"""The edge contract: what an edge gives the app, and what the app gives an edge.

An edge is a plain object with ``routes(host)`` (:class:`Edge`); each :class:`Route` names
a path (``{name}`` segments match one path segment: ``/v1/responses/{id}``), the methods
it answers, the handler, and the :class:`~.failures.ErrorStyle` its API speaks (for the
401, 405, 415 and refusals the app answers on its behalf). A handler gets a :class:`Call`
and returns the status it answered with (for ``llm_pipeline_requests_total``).

What a handler may ask of its :class:`Host` (the app)::

    await host.generate(call, prepare, errors)   a generation request's whole life: the
                                                 body, admission, ids, deadlines, the
                                                 graph, the reply (:mod:`.generation`)
    await host.read_body(call)                   the body, bounded (413)
    await host.offload(size, work, *args)        work(*args), off the event loop when
                                                 size (the body's bytes) is large

A generation edge is then two halves: ``prepare(body) -> Exchange`` (the parser: what the
graph takes, which :class:`Reply` renders its events) and the :class:`Reply` (the
renderer). A request naming a model is routed by :func:`resolve_model` (``host.models``,
:mod:`.models`): its graph, or the 404 every edge gives for a model it does not serve, or
that the request's key may not use (:attr:`Call.tenant`; :func:`visible_models` is what it
may list); the name resolved is the ``model`` label of the request's metrics
(``call.model``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, TypeVarTuple

from .failures import ApiError, ErrorStyle
from .tenants import ANONYMOUS, Tenant

if TYPE_CHECKING:
    from pipeline import Engine

    from .admission import Ticket
    from .asgi import Receive, Scope, Send
    from .guard import Guard
    from .metrics import ServerMetrics
    from .models import Models, ServedModel

__all__ = (
    "Call",
    "Edge",
    "Exchange",
    "Handler",
    "Host",
    "KeepAlive",
    "Prepare",
    "Reply",
    "Route",
    "check_model",
    "resolve_model",
    "visible_models",
)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
E_contra = TypeVar("E_contra", contravariant=True)

Handler = Callable[["Call"], Awaitable[int]]
"""A route's handler: answers the call, returns its status (499: the client left)."""


@dataclass(slots=True)
class Call:
    """One HTTP request on its way to a handler."""

    scope: Scope
    receive: Receive
    send: Send
    #: the values of the route's ``{name}`` segments
    params: Mapping[str, str] = field(default_factory=dict)
    #: who the request acts for (:meth:`~.guard.Guard.owner`): scopes stored state
    owner: str = ""
    #: the served model it was routed to ("" until it is, or for a request of no model):
    #: the ``model`` label of its metrics
    model: str = ""
    #: whose key it came with, and on what terms (a server without keys: everyone's)
    tenant: Tenant = ANONYMOUS
    #: a metered route's admission (:attr:`Route.metered`): what it holds of its key's
    #: limits (an embedding charges its input tokens to it); None on other routes
    ticket: Ticket | None = None

    @property
    def method(self) -> str:
        """The HTTP method."""
        method: str = self.scope["method"]
        return method

    @property
    def query(self) -> bytes:
        """The raw query string."""
        query: bytes = self.scope.get("query_string", b"")
        return query


@dataclass(frozen=True, slots=True)
class Route:
    """A path an edge serves."""

    path: str
    methods: frozenset[str]
    handler: Handler
    #: how refusals on this path are said (401, 405, 415, ...)
    errors: ErrorStyle
    #: the ``endpoint`` label of its requests in the metrics (None: the path)
    label: str | None = None
    #: whether it needs an API key when the server has keys
    guarded: bool = True
    #: whether its body is JSON: a body of another ``content-type`` (one a web page can
    #: make a browser send to any server without asking, form data, text) is a 415
    json: bool = True
    #: whether the app admits each call on its key's limits before the handler runs (a
    #: request of its requests per minute, a slot of its max_inflight: ``call.ticket``),
    #: as generation requests are admitted (:mod:`.admission`); a refusal is a 429
    metered: bool = False

    @property
    def endpoint(self) -> str:
        """The metrics label."""
        return self.label if self.label is not None else self.path


class Reply(Protocol[E_contra]):
    """How one request's events become its API's response: the edge's rendering half.

    A stream calls :meth:`start` with the graph's first event, then the renderer it
    returns for every event (that first one too); :meth:`visible` tells which event is
    the first worth committing the response for, :meth:`end` gives the stream's last bytes
    once the graph ended well, :meth:`failure` the last event of a stream that failed. A
    whole response calls :meth:`body` with every event instead.

    A reply may also have a ``usage`` attribute: the graph's ``Usage`` event once it went
    by, which a traced request's span records.
    """

    def start(self, first: E_contra, /) -> Callable[[E_contra], bytes]:
        """The renderer of this response's events (bytes, or b"" to write nothing)."""
        ...

    def visible(self, event: E_contra, /) -> bool:
        """Whether ``event`` shows the client something (the first one commits)."""
        ...

    async def end(self) -> bytes:
        """The stream's last bytes, after its last event (may store state first)."""
        ...

    def failure(self, error: ApiError, /) -> bytes:
        """A failed stream's last event."""
        ...

    async def body(self, events: list[Any], /) -> bytes:
        """The whole (non-streamed) response's JSON body."""
        ...

    @property
    def output_tokens(self) -> int:
        """Tokens generated so far (the response's usage, once seen), for the metrics."""
        ...


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """What a quiet stream writes to show it is alive, and after how long."""

    data: bytes
    interval: float


@dataclass(slots=True)
class Exchange:
    """A parsed request, ready for the graph: what an edge's ``prepare`` returns."""

    #: what the graph takes (for the default graph: an OpenAI chat or completions request)
    request: Any
    stream: bool
    reply: Reply[Any]
    #: the graph to run (None: the graph of ``model``)
    graph: Engine[Any, Any] | None = None
    keep_alive: KeepAlive | None = None
    #: the id the response is named by (for traces; None: OpenAI's, from the request id)
    response_id: str | None = None
    #: the served model it runs on, as :meth:`~.models.Models.resolve` named it (None: the
    #: default model); labels its metrics and its span
    model: str | None = None


Prepare = Callable[[bytes], Awaitable[Exchange]]
"""An edge's parser: the body -> an :class:`Exchange`; raises ``InvalidRequest`` or
:class:`~.failures.Refusal` to refuse it."""


class Host(Protocol):
    """What an edge's routes serve on (the app)."""

    @property
    def graph(self) -> Engine[Any, Any]:
        """The serving graph (the default graph: OpenAI requests in, OpenAI events out)."""
        ...

    @property
    def model_name(self) -> str:
        """The default model's name (what a request naming none gets)."""
        ...

    @property
    def models(self) -> Models:
        """Every model served, by name (:mod:`.models`)."""
        ...

    @property
    def guard(self) -> Guard:
        """API keys, admission, deadlines."""
        ...

    @property
    def metrics(self) -> ServerMetrics:
        """The server's metrics."""
        ...

    async def generate(
        self, call: Call, prepare: Prepare, errors: ErrorStyle, *, route: str | None = None
    ) -> int:
        """Serve ``call`` as a generation request (:mod:`.generation`): its body becomes
        an :class:`Exchange` through ``prepare``; ``errors`` says what went wrong before
        the response started; ``route`` names the endpoint in its span (None: the path).
        The status it ended with (499: the client left)."""
        ...

    async def read_body(self, call: Call) -> bytes:
        """The request's body.

        Raises:
            Refusal: over the server's limit (413).
            ClientGone: the client left first (the app counts a 499).
        """
        ...

    async def offload(self, size: int, work: Callable[[*Ts], T], *args: *Ts) -> T:
        """``work(*args)``, in a worker thread (one at a time) when ``size`` (the body's
        bytes) is over :data:`~.schema.OFF_LOOP_BYTES`, so that parsing a large body does
        not stall the other requests; on the event loop otherwise."""
        ...


class Edge(Protocol):
    """An API edge: the routes it adds to an app."""

    def routes(self, host: Host, /) -> Iterable[Route]:
        """This edge's routes on ``host`` (called once, when the app is built)."""
        ...


def resolve_model(call: Call, name: str | None, host: Host) -> ServedModel:
    """The model ``call`` runs on: the one its request names (None: the default, or the
    first its key may use), now the ``model`` label of its metrics.

    Raises:
        Refusal: ``not_found`` naming ``model`` for a model not served, or one the call's
            key may not use, alike (no label then: a label per unknown name would let
            clients grow the registry).
    """
    tenant = call.tenant
    model = host.models.resolve(name, tenant.may_use if tenant.models else None)
    call.model = model.name
    return model


def visible_models(call: Call, host: Host) -> list[ServedModel]:
    """The models served that ``call``'s key may use (what ``/v1/models`` lists)."""
    tenant = call.tenant
    return [model for model in host.models if tenant.may_use(model.name)]


def check_model(name: str | None, host: Host) -> ServedModel:
    """The model a request naming ``name`` runs on (None: the default); for a handler that
    has no :class:`Call` at hand (:func:`resolve_model` also labels the metrics).

    Raises:
        Refusal: ``not_found``, ``param: model``.
    """
    return host.models.resolve(name)
