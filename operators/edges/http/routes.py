"""What an edge is, to the app: the :class:`Route` s it serves (:class:`Edge`), and the
:class:`Host` it serves them on.

An edge is a plain object with ``routes(host)``: each route names a path (``{name}``
segments match one path segment: ``/v1/responses/{id}``), the methods it answers, the
handler, and the :class:`~.failures.ErrorStyle` its API speaks (for the 401, 405 and
refusals the app answers on its behalf). A handler gets a :class:`Call` and returns the
status it answered with (for ``llm_pipeline_requests_total``). Generation handlers hand
their request to ``host.generations.run(...)``, which does everything an API does not
decide (:mod:`.generation`); other handlers answer with :func:`.asgi.send_json`.

A request naming a model is routed by :func:`resolve_model` (``host.models``, :mod:`.models`):
its graph, or the 404 every edge gives for a model it does not serve; the name resolved is
the ``model`` label of the request's metrics.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from .failures import ErrorStyle

if TYPE_CHECKING:
    from pipeline import Engine

    from .asgi import Receive, Scope, Send
    from .generation import Generations
    from .guard import Guard
    from .metrics import ServerMetrics
    from .models import Models, ServedModel

__all__ = (
    "MODEL_SCOPE_KEY",
    "Call",
    "Edge",
    "Handler",
    "Host",
    "Route",
    "check_model",
    "resolve_model",
)

#: where the ASGI scope of a request keeps the name of the model it was routed to
MODEL_SCOPE_KEY: Final = "llm_pipeline.model"

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

    @property
    def method(self) -> str:
        """The HTTP method."""
        method: str = self.scope["method"]
        return method

    @property
    def model(self) -> str:
        """The served model the request was routed to ("" until it is, or for a request of
        no model): the ``model`` label of its metrics."""
        model: str = self.scope.get(MODEL_SCOPE_KEY, "")
        return model

    @model.setter
    def model(self, name: str) -> None:
        self.scope[MODEL_SCOPE_KEY] = name

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
    #: how refusals on this path are said (401, 405, ...)
    errors: ErrorStyle
    #: the ``endpoint`` label of its requests in the metrics (None: the path)
    label: str | None = None
    #: whether it needs an API key when the server has keys
    guarded: bool = True

    @property
    def endpoint(self) -> str:
        """The metrics label."""
        return self.label if self.label is not None else self.path


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
    def generations(self) -> Generations:
        """The requests in flight and the rules they run under."""
        ...

    @property
    def guard(self) -> Guard:
        """API keys, admission, deadlines."""
        ...

    @property
    def metrics(self) -> ServerMetrics:
        """The server's metrics."""
        ...


class Edge(Protocol):
    """An API edge: the routes it adds to an app."""

    def routes(self, host: Host, /) -> Iterable[Route]:
        """This edge's routes on ``host`` (called once, when the app is built)."""
        ...


def resolve_model(call: Call, name: str | None, host: Host) -> ServedModel:
    """The model ``call`` runs on: the one its request names (None: the default), now the
    ``model`` label of its metrics.

    Raises:
        Refusal: ``not_found`` naming ``model`` for a model not served (no label then: a
            label per unknown name would let clients grow the registry).
    """
    model = host.models.resolve(name)
    call.model = model.name
    return model


def check_model(name: str | None, host: Host) -> ServedModel:
    """The model a request naming ``name`` runs on (None: the default); for a handler that
    has no :class:`Call` at hand (:func:`resolve_model` also labels the metrics).

    Raises:
        Refusal: ``not_found``, ``param: model``.
    """
    return host.models.resolve(name)
