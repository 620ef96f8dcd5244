"""One exception hierarchy for the whole framework.

Errors are raised, never returned. The tree is grouped by what a caller can do about it::

    PipelineError
    ├── LinkError              wiring mistake, raised when a graph is built or first used
    └── RequestError           one request failed; carries .request_id
        ├── InvalidRequest     rejected at the edge (HTTP 400)
        ├── CapacityExhausted  nothing can take it (HTTP 503); never migrated
        │   └── EngineUnavailable    its engine is stalled, restarting or dead (Retry-After)
        ├── EngineError        the engine failed the request (HTTP 500); never migrated
        └── WorkerLost         the worker went away; Migration retries exactly this subtree
            ├── ConnectFailed        the request never reached a worker (or no server)
            ├── StreamDisconnected   the stream broke after it started
            ├── ResponseTimeout      the worker stopped answering
            ├── EngineStalled        its engine stopped making progress (pipeline.health)
            └── EngineDead           its engine's process or thread died

Foreign exceptions are translated into this tree at exactly one boundary (a transport, the
HTTP edge), always chained with ``raise ... from exc``. Cancellation is never one of these:
it is the async library's own exception and must propagate untouched.
"""

from __future__ import annotations

__all__ = (
    "CapacityExhausted",
    "ConnectFailed",
    "EngineDead",
    "EngineError",
    "EngineStalled",
    "EngineUnavailable",
    "InvalidRequest",
    "LinkError",
    "PipelineError",
    "RequestError",
    "ResponseTimeout",
    "StreamDisconnected",
    "WorkerLost",
)


class PipelineError(Exception):
    """Base class of every error this framework raises on purpose."""


class LinkError(PipelineError):
    """A graph is wired wrongly: no engine, or a stage that is not an operator or engine.

    Raised by :func:`pipeline.link` at link time, or on first use when the mistake can only
    be seen then (a ``generate`` that returns a coroutine instead of an async iterator).
    """


class RequestError(PipelineError):
    """One request failed; the graph itself is fine and keeps serving others."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: id of the failed request, when the raiser knew it
        self.request_id = request_id


class InvalidRequest(RequestError):
    """The request is malformed or asks for something impossible (HTTP 400).

    ``param`` names the offending field when there is one.
    """

    def __init__(
        self, message: str, *, param: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id)
        #: the request field at fault, e.g. ``"max_tokens"``
        self.param = param


class CapacityExhausted(RequestError):
    """No worker can take the request now (HTTP 503). Retrying elsewhere would not help."""


class EngineUnavailable(CapacityExhausted):
    """The engine that would serve the request is stalled, restarting or dead (HTTP 503).

    Raised at once rather than letting the request hang on an engine known not to answer
    (:mod:`pipeline.health`); ``retry_after`` is the seconds a client should wait before
    trying again (the ``Retry-After`` header).
    """

    def __init__(
        self, message: str, *, retry_after: int = 1, request_id: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id)
        #: seconds a client should wait before retrying
        self.retry_after = retry_after


class EngineError(RequestError):
    """The engine failed this request (HTTP 500). Not a lost worker, so never migrated."""


class WorkerLost(RequestError):
    """The worker serving the request went away. The only errors a retry may catch."""


class ConnectFailed(WorkerLost):
    """The request could not be delivered to a worker.

    Also what a transport's ``connect()`` raises when it reached no server in time
    (``request_id`` is None then).
    """


class StreamDisconnected(WorkerLost):
    """The response stream broke off before it finished."""


class ResponseTimeout(WorkerLost):
    """The worker stopped answering within the allowed time."""


class EngineStalled(WorkerLost):
    """The engine serving the request stopped making progress (no output and no reported
    work within its stall timeout, :mod:`pipeline.health`): the request is taken from it so
    that Migration can finish it on another worker, instead of hanging with it."""


class EngineDead(WorkerLost):
    """The engine serving the request died: its process or thread is gone, and every
    request it held with it.

    What an engine raises to report its own death (vLLM's ``EngineDeadError``, a scheduler
    thread that raised), so that a :class:`pipeline.health.Supervised` engine is rebuilt
    and Migration moves the request elsewhere, rather than reading it as one failed
    request (an :class:`EngineError`) of an engine that goes on serving.
    """
