"""What an edge is, to the app: the :class:`Route` s it serves (:class:`Edge`), and the
:class:`Host` it serves them on.

An edge is a plain object with ``routes(host)``: each route names a path (``{name}``
segments match one path segment: ``/v1/responses/{id}``), the methods it answers, the
handler, and the :class:`~.failures.ErrorStyle` its API speaks (for the 401, 405 and
refusals the app answers on its behalf). A handler gets a :class:`Call` and returns the
status it answered with (for ``llm_pipeline_requests_total``). Generation handlers hand
their request to ``host.generations.run(...)``, which does everything an API does not
decide (:mod:`.generation`); other handlers answer with :func:`.asgi.send_json`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .failures import ErrorStyle, Refusal, unknown_model

if TYPE_CHECKING:
    from pipeline import Engine

    from .asgi import Receive, Scope, Send
    from .generation import Generations
    from .guard import Guard
    from .metrics import ServerMetrics

__all__ = ("Call", "Edge", "Handler", "Host", "Route", "check_model")

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
        """The one model served."""
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


def check_model(name: str | None, host: Host) -> None:
    """Refuse a request naming a model other than the served one (None: it named none).

    Raises:
        Refusal: ``not_found``, ``param: model``.
    """
    if name is not None and name != host.model_name:
        raise Refusal(unknown_model(name, host.model_name))
