"""Writing a graph's events as server-sent events: :func:`stream_response`, for every edge.

What the bytes say is the edge's (a :class:`~.routes.Reply` renders each event); when
they leave is decided here, the same way for every API. Every event is its own SSE event,
but writes are coalesced: the events that are ready when the writer asks for the next one
leave in one socket write, made the moment the graph would wait
(:func:`pipeline.next_or_wait`), at the latest after :data:`MAX_PENDING` events or
:data:`MAX_HOLD` seconds. Nothing is written before the first visible event, so a chat's
role chunk travels with its first token and an error before any output still gets its
status code; the end of a stream leaves in one write.

A reply with a keep-alive (Anthropic's ``ping``) also gets it written whenever the stream
has been quiet for its interval, from the request's watcher task (:func:`keep_alive`):
a long prefill then shows the client a live connection, at the price of committing the
status before the first token.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final

import anyio

from pipeline import Context, next_or_wait, open_stream

from .asgi import Message, Send, id_header, send_json
from .failures import ApiError, describe_failure
from .request_span import record_first_token

if TYPE_CHECKING:
    from .running import Running

__all__ = (
    "CLIENT_GONE",
    "LAST_WRITE_TIMEOUT",
    "MAX_HOLD",
    "MAX_PENDING",
    "StreamState",
    "WriteFailed",
    "keep_alive",
    "stream_response",
    "stream_start",
)

#: the status recorded when the client went away (nginx's "client closed request")
CLIENT_GONE: Final = 499
#: a stream writes at the latest when this many rendered events are waiting ...
MAX_PENDING: Final = 64
#: ... or when the oldest of them has waited this long (seconds)
MAX_HOLD: Final = 0.02
#: how long a failed stream's last event may wait for a client that stopped reading: after
#: that the stream is abandoned (the connection closed) rather than left to hold the
#: server's exit (the drain's error events are written within its grace period)
LAST_WRITE_TIMEOUT: Final = 1.0
SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class WriteFailed(Exception):
    """A write to the client failed; the cause is the transport's own exception."""


class StreamState:
    """What the keep-alive task shares with a stream's writer (both on the event loop).

    The writer updates it per socket write, never per event.
    """

    __slots__ = ("committed", "done", "headers", "last_write", "pending", "ready", "writing")

    def __init__(self) -> None:
        #: the reply has rendered the stream's first event (a keep-alive may follow it)
        self.ready = False
        #: the response head has been sent
        self.committed = False
        #: the last write was made (or the stream failed): nothing more may be sent
        self.done = False
        #: when the last write was made (perf_counter; 0: none yet)
        self.last_write = 0.0
        #: a write is in progress (the writer awaits the transport)
        self.writing = False
        #: rendered events not written yet (the writer's own list)
        self.pending: list[bytes] = []
        #: the response head's extra headers (the key's limits), read when it is sent
        self.headers: Callable[[], tuple[tuple[bytes, bytes], ...]] | None = None


async def stream_response(run: Running, state: StreamState | None = None) -> int:
    """Stream the graph's events as server-sent events, coalescing ready ones.

    Every event is rendered once (``reply.start(first)`` gives the renderer), into
    ``pending``. Nothing is written before the first visible event (so an early error
    still gets its status code, in ``run.errors``' words); that write carries the headers
    and everything held so far. After it, ``pending`` is written whenever the graph would
    wait for its next event (:func:`pipeline.next_or_wait`), once it holds :data:`MAX_PENDING`
    events or its oldest is :data:`MAX_HOLD` seconds old, and at the end, with
    ``reply.end()``'s bytes. A failed write is the connection's problem, not the graph's:
    it propagates (the stream is closed on the way out) instead of becoming an error event.
    A request the server killed (its deadline, the drain's abort) ends with the reply's
    failure event: ``run.ended_by_server(ctx)`` names it (None: the client left).
    ``run.span`` (a traced request's) hears of the first token.
    """
    ctx, send, reply, errors, metrics, span = (
        run.ctx,
        run.send,
        run.reply,
        run.errors,
        run.metrics,
        run.span,
    )
    started = run.started
    shared = StreamState() if state is None else state
    shared.headers = run.headers
    on_head = run.on_head
    pending = shared.pending
    committed = False
    held_since = 0.0  # when the oldest pending event was rendered
    last_write = 0.0
    observe_gap = metrics.inter_token_latency.observe
    visible = reply.visible

    async def write(more_body: bool = True) -> None:
        nonlocal last_write
        data = b"".join(pending)
        pending.clear()
        shared.writing = True
        try:
            await send({"type": "http.response.body", "body": data, "more_body": more_body})
        except Exception as exc:
            shared.done = True
            raise WriteFailed from exc
        finally:
            shared.writing = False
        now = perf_counter()
        if last_write:
            observe_gap(now - last_write)
        last_write = shared.last_write = now
        if not more_body:
            shared.done = True

    async def commit() -> None:
        nonlocal committed
        committed = shared.committed = True
        try:
            await send(stream_start(ctx, shared.headers))
        except Exception as exc:
            shared.done = True
            raise WriteFailed from exc

    async def send_error(error: ApiError) -> int:
        """An error as the response (nothing written yet) or as the stream's last event."""
        if not (committed or shared.committed):
            shared.done = True
            rendered = errors.render(error, ctx.id)
            await send_json(send, rendered.status, rendered.body, rendered.headers + id_header(ctx))
            return rendered.status
        pending.append(reply.failure(error))
        with anyio.move_on_after(LAST_WRITE_TIMEOUT):  # (a client that stopped reading)
            await write(more_body=False)
        return errors.render(error, ctx.id).status

    async def end_killed() -> int:
        ended = run.ended_by_server(ctx)
        if ended is None:
            shared.done = True
            return CLIENT_GONE
        return await send_error(ended)

    try:
        try:
            async with open_stream(run.graph, ctx) as stream:
                next_event = stream.__anext__
                head = await next_event()
                if on_head is not None:
                    await on_head(head)
                render = reply.start(head)
                data = render(head)
                if data:
                    pending.append(data)
                shared.ready = True
                while True:
                    try:
                        if pending and committed:
                            event = await next_or_wait(next_event(), write)
                        else:
                            event = await next_event()
                    except StopAsyncIteration:
                        break
                    data = render(event)
                    if not data:
                        continue
                    if committed:
                        if not pending:
                            held_since = perf_counter()
                        pending.append(data)
                        if len(pending) >= MAX_PENDING or (perf_counter() - held_since >= MAX_HOLD):
                            await write()
                    else:
                        pending.append(data)
                        if shared.committed:  # the keep-alive committed the response
                            committed = True
                            held_since = perf_counter()
                        elif visible(event):
                            await commit()
                            await write()
                            metrics.time_to_first_token.observe(last_write - started)
                            if span is not None:
                                record_first_token(span, started)
            if ctx.is_killed:
                return await end_killed()
            tail = await reply.end()
            if not (committed or shared.committed):
                await commit()
            pending.append(tail)
            await write(more_body=False)
            return 200
        except WriteFailed:
            if ctx.is_killed:  # the client went away: its writes may fail on the way
                return CLIENT_GONE
            raise
        except Exception as exc:
            if ctx.is_killed:
                return await end_killed()
            return await send_error(describe_failure(exc, ctx.id))
    finally:
        shared.done = True
        tokens = reply.output_tokens
        if tokens:
            metrics.output_tokens.inc(tokens)


async def keep_alive(
    send: Send, ctx: Context[Any], state: StreamState, data: bytes, interval: float
) -> None:
    """Write ``data`` (a comment or a ping event) whenever the stream has written nothing
    for ``interval`` seconds, until it is done; cancelled with the request's watcher.

    Runs beside the writer on the same event loop, so it only acts while the writer waits
    for the graph: never during a write, never after the last one. The first keep-alive
    commits the response (with what the writer holds), as the first token would have.
    """
    while not state.done:
        since = state.last_write or perf_counter()
        await anyio.sleep(max(0.0, since + interval - perf_counter()))
        if (
            state.done
            or state.writing
            or not state.ready
            or perf_counter() - (state.last_write or since) < interval
        ):
            continue
        state.writing = True
        try:
            if not state.committed:
                state.committed = True
                await send(stream_start(ctx, state.headers))
            state.pending.append(data)
            body = b"".join(state.pending)
            state.pending.clear()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        except Exception:  # the connection is gone: the writer finds out on its own
            return
        finally:
            state.writing = False
        state.last_write = perf_counter()


def stream_start(
    ctx: Context[Any], headers: Callable[[], tuple[tuple[bytes, bytes], ...]] | None = None
) -> Message:
    """The head of an SSE response (status 200, ``x-request-id``, and ``headers()``)."""
    extra = () if headers is None else headers()
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": [*SSE_HEADERS, *id_header(ctx), *extra],
    }
