"""Writing a graph's events as server-sent events: :func:`stream_response`.

Every event is its own SSE ``data:`` line, but writes are coalesced: the events that are
ready when the writer asks for the next one leave in one socket write, made the moment the
graph would wait (:func:`pipeline.next_or_wait`), at the latest after :data:`MAX_PENDING`
events or :data:`MAX_HOLD` seconds. Nothing is written before the first visible text, so
the role chunk travels with the first token and an error before any output still gets its
status code; the finish chunk, usage and ``[DONE]`` leave in one write.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final

from pipeline import Context, next_or_wait, open_stream

from .asgi import Message, Send, describe_failure, id_header, send_json
from .events import OpenAIEvent, ResponseHead, Usage
from .request_span import record_first_token, record_usage
from .sse import DONE, SseRenderer, is_visible

if TYPE_CHECKING:
    from pipeline import Engine
    from pipeline.tracing import Span

    from .metrics import ServerMetrics
    from .preprocessor import OpenAIRequest

__all__ = ("CLIENT_GONE", "MAX_HOLD", "MAX_PENDING", "WriteFailed", "stream_response")

#: the status recorded when the client went away (nginx's "client closed request")
CLIENT_GONE: Final = 499
#: a stream writes at the latest when this many rendered events are waiting ...
MAX_PENDING: Final = 64
#: ... or when the oldest of them has waited this long (seconds)
MAX_HOLD: Final = 0.02
SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class WriteFailed(Exception):
    """A write to the client failed; the cause is the transport's own exception."""


async def stream_response(
    graph: Engine[OpenAIRequest, OpenAIEvent],
    ctx: Context[OpenAIRequest],
    send: Send,
    *,
    started: float,
    include_usage: bool,
    metrics: ServerMetrics,
    ended_by_server: Callable[[Context[Any]], tuple[int, bytes] | None],
    span: Span | None = None,
) -> int:
    """Stream the graph's events as server-sent events, coalescing ready ones.

    Every event is rendered once, into ``pending``. Nothing is written before the first
    visible text (so an early error still gets its status code); that write carries
    the headers and everything held so far. After it, ``pending`` is written whenever
    the graph would wait for its next event (:func:`pipeline.next_or_wait`), once it
    holds :data:`MAX_PENDING` events or its oldest is :data:`MAX_HOLD` seconds old,
    and at the end. A failed write is the connection's problem, not the graph's: it
    propagates (the stream is closed on the way out) instead of becoming an error event.
    A request the server killed (its deadline, :meth:`~.server.OpenAIApp.abort`) ends
    with an error event: ``ended_by_server(ctx)`` names it (None: the client left).
    ``span`` (a traced request's) hears of the first token and the usage.
    """
    pending: list[bytes] = []
    committed = False
    held_since = 0.0  # when the oldest pending event was rendered
    last_write = 0.0
    tokens = 0
    observe_gap = metrics.inter_token_latency.observe

    async def write(more_body: bool = True) -> None:
        nonlocal last_write
        data = b"".join(pending)
        pending.clear()
        try:
            await send({"type": "http.response.body", "body": data, "more_body": more_body})
        except Exception as exc:
            raise WriteFailed from exc
        now = perf_counter()
        if last_write:
            observe_gap(now - last_write)
        last_write = now

    async def send_error(status: int, body: bytes) -> int:
        """An error as the response (nothing written yet) or as the stream's last event."""
        if not committed:
            await send_json(send, status, body, id_header(ctx))
            return status
        pending.append(b"data: " + body + b"\n\n")
        await write(more_body=False)
        return status

    async def end_killed() -> int:
        ended = ended_by_server(ctx)
        return CLIENT_GONE if ended is None else await send_error(*ended)

    try:
        async with open_stream(graph, ctx) as stream:
            next_event = stream.__anext__
            head = await next_event()
            if not isinstance(head, ResponseHead):
                raise TypeError(
                    f"the graph's first event is {type(head).__name__}, not a ResponseHead"
                )
            render = SseRenderer(head, include_usage=include_usage).render
            while True:
                try:
                    if pending and committed:
                        event = await next_or_wait(next_event(), write)
                    else:
                        event = await next_event()
                except StopAsyncIteration:
                    break
                if type(event) is Usage:
                    tokens = event.completion_tokens
                    if span is not None:
                        record_usage(span, event, list(event.finish_reasons))
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
                    if is_visible(event):
                        committed = True
                        try:
                            await send(_stream_start(ctx))
                        except Exception as exc:
                            raise WriteFailed from exc
                        await write()
                        metrics.time_to_first_token.observe(last_write - started)
                        if span is not None:
                            record_first_token(span, started)
        if ctx.is_killed:
            return await end_killed()
        if not committed:
            try:
                await send(_stream_start(ctx))
            except Exception as exc:
                raise WriteFailed from exc
        pending.append(DONE)
        await write(more_body=False)
        return 200
    except WriteFailed:
        if ctx.is_killed:  # the client went away: its writes may fail on the way
            return CLIENT_GONE
        raise
    except Exception as exc:
        if ctx.is_killed:
            return await end_killed()
        return await send_error(*describe_failure(exc, ctx.id))
    finally:
        if tokens:
            metrics.output_tokens.inc(tokens)


def _stream_start(ctx: Context[Any]) -> Message:
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": [*SSE_HEADERS, *id_header(ctx)],
    }
