"""One generation request while it runs: :class:`Running`, the record the writers share.

:class:`~.generation.Generations` builds it once the request was admitted; the stream
writer (:func:`~.sse_writer.stream_response`) and the whole-response path read it, instead
of each taking the same ten arguments.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline import Context, Engine
    from pipeline.tracing import Span

    from .asgi import Send
    from .failures import ApiError, ErrorStyle
    from .metrics import ModelMetrics
    from .routes import Reply

__all__ = ("Running",)


@dataclass(slots=True, kw_only=True)
class Running:
    """A generation request on its way through the graph."""

    graph: Engine[Any, Any]
    ctx: Context[Any]
    send: Send
    #: the edge's rendering half
    reply: Reply[Any]
    #: how an error before the first byte is said
    errors: ErrorStyle
    #: when the request arrived (perf_counter): time to first token, the span's
    started: float
    #: its model's series
    metrics: ModelMetrics
    #: why the server killed it (its deadline, the drain's abort), or None: the client left
    ended_by_server: Callable[[Context[Any]], ApiError | None]
    #: a traced request's span (None: untraced)
    span: Span | None = None
    #: called with the graph's first event (its head, before the engine has done anything:
    #: the prompt's tokens are known), may refuse the request by raising ``Refusal``
    on_head: Callable[[Any], Awaitable[None]] | None = None
    #: the headers of a successful response beyond ``x-request-id`` (the key's limits),
    #: read when the response starts
    headers: Callable[[], tuple[tuple[bytes, bytes], ...]] | None = None
