"""The worker side of one stream: rebuild the Context, run the engine, pump its outputs.

:class:`~.worker.NatsWorker` owns the subscriptions, the task group and the lifecycle;
for each request it makes a :class:`~.outbox.Served` and runs :meth:`StreamServer.serve`
in its task group. What to send and when is decided here (batching, flow control); the
frames are published by the worker's :class:`~.outbox.Outbox` (sequence numbers, bus
outages, payloads too large).

Batching (wire version 2). A NATS message costs ~13 µs of Python client CPU on each side,
more than everything else the transport does for a token, so outputs that are ready
together travel together. After each output the server asks for the next one with
:func:`pipeline.next_or_wait` and holds what it has while the engine has more ready at
once (several choices of one step, a speculative burst, an engine that runs ahead of a
busy worker). What it holds goes out as one BATCH message (one output: DATA)

* the moment the engine would wait, so an engine that paces its tokens still gets one
  message per token and latency at low load is what it was without batching (the first
  output is never held, so neither is the time to first token);
* when :data:`MAX_BATCH` outputs are held or the oldest has waited :data:`MAX_HOLD`, so
  an engine that is always ahead still streams;
* before the stream's END or ERR, so an error arrives after the outputs produced before it.

Flow control (wire version 3). A client that sent a ``window`` has granted that many
outputs; the server sends no more than the client granted. When it pulls an output past
the credit it sends the ones before it, holds that one, and waits for a CREDIT without
asking the engine for more (an async generator that is not iterated is paused, which is
all the back-pressure an engine needs). The check is one comparison per output; the wait
costs nothing until it happens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, final

import anyio

from pipeline.context import Context
from pipeline.errors import EngineError, StreamDisconnected
from pipeline.ready import next_or_wait
from pipeline.streams import open_stream

from . import wire
from .wire import DATA

if TYPE_CHECKING:
    from pipeline.operator import Engine
    from pipeline.tracing import Span, Tracer

    from .outbox import Outbox, Served

__all__ = ("MAX_BATCH", "MAX_HOLD", "StreamServer")

In = TypeVar("In")
Out = TypeVar("Out")

#: the most outputs one message carries
MAX_BATCH: Final = 32
#: the longest (seconds) a ready output is held back for the ones after it
MAX_HOLD: Final = 0.005


@final
class StreamServer(Generic[In, Out]):
    """Serves requests of one worker: one :meth:`serve` call per request, in its own task.

    Its ``outbox`` publishes the frames; it keeps the counts of streams waiting for credit.
    """

    __slots__ = ("_engine", "_tracer", "outbox", "paused", "pauses", "worker_id")

    def __init__(
        self, engine: Engine[In, Out], outbox: Outbox, tracer: Tracer | None = None
    ) -> None:
        self._engine = engine
        self.outbox = outbox
        self.worker_id = outbox.worker_id
        self._tracer = tracer
        #: streams waiting for their client's credit now
        self.paused = 0
        #: times a stream waited for its client's credit
        self.pauses = 0

    async def serve(self, served: Served, data: bytes) -> None:
        """Decode the request ``data``, stream the engine's outputs, end with END or ERR."""
        try:
            request = self.outbox.codec.decode(data)
            timeout = request["timeout"]
            ctx = Context.new(
                request["data"],
                id=str(request["id"]),
                metadata=request["metadata"],
                deadline=None if timeout is None else anyio.current_time() + max(0.0, timeout),
            )
            version = request.get("wire", 1)
            batching = version >= 2
            window = request.get("window")
            if batching and window is not None:  # (flow control rides on the batching pump)
                served.limit = max(1, int(window))
                served.retained = deque()
            served.beats_out_of_band = version >= 3
            served.merging = version >= 4
        except Exception as exc:
            undecodable = EngineError(f"worker {self.worker_id} cannot decode the request: {exc}")
            await self.outbox.send(served, wire.ERR, wire.error_body(undecodable, ""))
            return
        tracer = self._tracer
        span = None
        if tracer is not None:
            span = self._worker_span(served, ctx)
            if tracer.stages:
                ctx = ctx.with_span(span)
        served.ctx = ctx
        try:
            await self._serve(served, ctx, batching, span)
        finally:
            if span is not None:
                span.end()

    def _worker_span(self, served: Served, ctx: Context[Any]) -> Span:
        """A traced request's first span here: from its arrival, under the client's span
        (the ``traceparent`` its metadata carries)."""
        assert self._tracer is not None
        span = self._tracer.start("worker", traceparent=ctx.metadata.get("traceparent"))
        span.start_ns = served.received_ns
        span.set("llm_pipeline.worker.id", self.worker_id)
        span.set("llm_pipeline.request.id", ctx.id)
        span.add_event("dequeued")  # the request's task started: the queue wait ends
        return span

    async def _serve(
        self, served: Served, ctx: Context[Any], batching: bool, span: Span | None
    ) -> None:
        """Stream ``ctx``'s outputs to ``served``'s client; END or ERR at the end (a
        failure also marks the request's ``span``)."""
        request_id = ctx.id
        if served.kill_early:
            ctx.kill()
        elif served.stop_early:
            ctx.stop_generating()
        await self.outbox.send(served, wire.START, self.worker_id)
        error: Exception | None = None
        try:
            async with open_stream(self._engine, ctx) as stream:
                if batching:
                    await self._pump(served, stream)
                else:
                    async for item in stream:
                        await self.outbox.send(served, DATA, item)
        except Exception as exc:
            error = exc
        if served.gone:
            return
        try:
            await self.outbox.flush(served)  # what was held when the stream ended goes first
        except Exception as exc:  # an output that cannot be encoded or is too large
            error = error or exc
        if error is not None:
            if span is not None:
                span.set_error(f"{type(error).__name__}: {error}")
            await self.outbox.send(served, wire.ERR, wire.error_body(error, request_id))
        elif served.shutdown:
            lost = StreamDisconnected(f"worker {self.worker_id} shut down", request_id=request_id)
            await self.outbox.send(served, wire.ERR, wire.error_body(lost, request_id))
        elif not ctx.is_killed:  # killed by its deadline: the client gave up at the same time
            await self.outbox.send(served, wire.END, None)

    async def abandon(self, served: Served) -> None:
        """End a stream whose task was cancelled mid-way with an ERR (StreamDisconnected).

        Outputs still held are dropped: the client replays what it received.
        """
        served.held.clear()
        request_id = served.ctx.id if served.ctx is not None else ""
        lost = StreamDisconnected(f"worker {self.worker_id} shut down", request_id=request_id)
        await self.outbox.send(served, wire.ERR, wire.error_body(lost, request_id))

    async def _pump(self, served: Served, stream: AsyncIterator[Any]) -> None:
        """Move ``stream``'s outputs into batches until it ends (see the module docstring)."""
        held = served.held
        next_item = stream.__anext__

        async def flush() -> None:
            await self.outbox.flush(served)

        try:
            first = await next_item()
        except StopAsyncIteration:
            return
        # Never held: the time to first token is as before.
        await self.outbox.send(served, DATA, first)
        pulled = 1  # outputs taken from the engine
        while True:
            try:
                item = await (next_or_wait(next_item(), flush) if held else next_item())
            except StopAsyncIteration:
                return
            pulled += 1
            now = time.monotonic()
            if not held:
                served.held_since = now
            held.append(item)
            if pulled > served.limit:
                await self._wait_for_credit(served, pulled)
            elif len(held) >= MAX_BATCH or now - served.held_since >= MAX_HOLD:
                await self.outbox.flush(served)

    async def _wait_for_credit(self, served: Served, pulled: int) -> None:
        """The output just pulled is one past the client's credit: send the ones before it,
        then hold it until the client has granted it.

        (Pulling it first means a stream that ends exactly at its credit ends without a
        round trip.) A kill (the client went away, a shutdown) cancels the wait with the
        stream.
        """
        over = served.held.pop()
        await self.outbox.flush(served)
        served.held.append(over)
        served.held_since = time.monotonic()
        self.pauses += 1
        self.paused += 1
        try:
            while pulled > served.limit:
                served.credit = anyio.Event()
                await served.credit.wait()
        finally:
            served.credit = None
            self.paused -= 1
