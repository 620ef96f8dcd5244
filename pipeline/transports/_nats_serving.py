"""The worker side of one stream: rebuild the Context, run the engine, send its frames.

:class:`~._nats_worker.NatsWorker` owns the subscriptions, the task group and the
lifecycle; for each request it makes a :class:`Served` and runs :meth:`StreamServer.serve`
in its task group. Frames are described in ``_wire``.

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

A batch over the server's payload limit is split in halves; an output that cannot be
encoded fails the stream (EngineError) after the outputs before it went out.

Bus outages. While the worker's connection to NATS is down, frames are not handed to
nats-py (whose buffer would flush them the moment the connection is back, before the
client has resubscribed its inbox: lost, and answered "no responders"). Every stream is
*parked* instead: its frames wait, in order, with their sequence numbers, until its client
pings it from its own re-established connection (:meth:`StreamServer.resume`). The ping
says which frame the client expects next: the frames lost with the connection are sent
again first (a flow-controlled stream keeps what it sent until the client acknowledges
it, in its CREDIT messages), so the stream resumes with no gap. What waits is bounded by
flow control: no credit arrives meanwhile, so the engine is paused after a window's
worth of outputs. A parked stream whose client never comes back is cut off (see
:class:`~._nats_worker.NatsWorker`).

Flow control (wire version 3). A client that sent a ``window`` has granted that many
outputs; the server sends no more than the client granted. When it pulls an output past
the credit it sends the ones before it, holds that one, and waits for a CREDIT without
asking the engine for more (an async generator that is not iterated is paused, which is
all the back-pressure an engine needs). The check is one comparison per output; the wait
costs nothing until it happens.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, final

import anyio
import nats.errors

from pipeline.context import Context
from pipeline.errors import EngineError, StreamDisconnected
from pipeline.ready import next_or_wait
from pipeline.streams import open_stream

from . import _wire
from ._wire import BATCH, DATA

if TYPE_CHECKING:
    from nats.aio.client import Client

    from pipeline.operator import Engine
    from pipeline.tracing import Span, Tracer

    from .codec import Codec

__all__ = ("MAX_BATCH", "MAX_HOLD", "Served", "StreamServer")

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")

#: the most outputs one message carries
MAX_BATCH: Final = 32
#: the longest (seconds) a ready output is held back for the ones after it
MAX_HOLD: Final = 0.005

_HEARTBEAT_HEADERS: Final = {_wire.HEARTBEAT: "1"}


@final
class Served:
    """One request a worker is serving: its reply inbox, sequence and held outputs."""

    __slots__ = (
        "beat",
        "beats_out_of_band",
        "credit",
        "ctx",
        "gone",
        "held",
        "held_since",
        "inbox",
        "kill_early",
        "limit",
        "parked",
        "parked_at",
        "received_ns",
        "reply",
        "resuming",
        "retained",
        "seq",
        "shutdown",
        "stop_early",
        "unparked",
    )

    def __init__(self, inbox: str, reply: str) -> None:
        self.inbox = inbox  # the client's reply inbox: the stream's identity
        self.reply = reply  # where NATS reports "no responders" on that inbox
        self.received_ns = time.time_ns()  # when the request arrived (a traced one's start)
        self.ctx: Context[Any] | None = None
        self.seq = 0  # messages sent
        self.beat = 0  # ``seq`` at the previous heartbeat round
        self.gone = False  # the client no longer reads: send nothing more
        self.shutdown = False  # cut off by a worker shutdown
        self.stop_early = False  # stop/kill arrived before the Context existed
        self.kill_early = False
        self.held: list[Any] = []  # outputs ready but not sent yet
        self.held_since = 0.0  # when the oldest of them was produced (time.monotonic)
        self.limit: float = math.inf  # outputs the client granted in all (flow control)
        self.credit: anyio.Event | None = None  # set when more is granted, while waiting
        self.beats_out_of_band = False  # heartbeats without a sequence number (wire 3)
        #: (seq, frame) held through a bus outage, in order
        self.parked: list[tuple[int, bytes]] | None = None
        self.parked_at = 0.0  # when it was parked (time.monotonic)
        self.resuming = False  # parked frames are being sent
        #: set when a parking ends: its frames were all sent, or its client is gone
        self.unparked: anyio.Event | None = None
        #: (seq, frame) sent and not acknowledged yet (flow-controlled streams only)
        self.retained: deque[tuple[int, bytes]] | None = None

    def acknowledge(self, next_seq: int) -> None:
        """The client has every frame before ``next_seq``: forget them."""
        retained = self.retained
        while retained and retained[0][0] < next_seq:
            retained.popleft()

    def park(self) -> None:
        """Hold every frame from now on until :meth:`StreamServer.resume` (a bus outage)."""
        if self.parked is None and not self.gone:
            self.parked = []
            self.parked_at = time.monotonic()
            self.unparked = anyio.Event()

    def unpark(self) -> None:
        """The parking is over (resumed, or its client is gone)."""
        self.parked = None
        if self.unparked is not None:
            self.unparked.set()

    async def wait_unparked(self) -> None:
        """Return once no frame is parked: a stream that ended in an outage keeps its END
        (and the outputs before it) until its client is back for them or given up."""
        while self.parked is not None and not self.gone and self.unparked is not None:
            await self.unparked.wait()

    def grant(self, total: int) -> None:
        """The client granted ``total`` outputs in all (a CREDIT); stale grants are no-ops."""
        if total > self.limit:
            self.limit = total
            if self.credit is not None:
                self.credit.set()

    def stop(self) -> None:
        if self.ctx is None:
            self.stop_early = True
        else:
            self.ctx.stop_generating()

    def kill(self) -> None:
        if self.ctx is None:
            self.kill_early = True
        else:
            self.ctx.kill()


@final
class StreamServer(Generic[In, Out]):
    """Serves requests of one worker: one :meth:`serve` call per request, in its own task.

    It also keeps the worker's counts of what was sent, and of clients that went away.
    """

    __slots__ = (
        "_codec",
        "_engine",
        "_tracer",
        "clients_gone",
        "messages",
        "nc",
        "outputs",
        "paused",
        "pauses",
        "worker_id",
    )

    def __init__(
        self,
        engine: Engine[In, Out],
        codec: Codec,
        worker_id: str,
        tracer: Tracer | None = None,
    ) -> None:
        self._engine = engine
        self._codec = codec
        self.worker_id = worker_id
        self._tracer = tracer
        #: the worker's connection, set while it serves
        self.nc: Client | None = None
        #: stream messages published (every frame kind)
        self.messages = 0
        #: outputs published (in DATA and BATCH frames)
        self.outputs = 0
        #: requests cut short because the client cancelled or vanished
        self.clients_gone = 0
        #: streams waiting for their client's credit now
        self.paused = 0
        #: times a stream waited for its client's credit
        self.pauses = 0

    def client_gone(self, served: Served) -> None:
        """The client of ``served`` cancelled or vanished: kill it and send nothing more."""
        if not served.gone:
            served.gone = True
            self.clients_gone += 1
            served.kill()
            if served.unparked is not None:
                served.unparked.set()

    async def serve(self, served: Served, data: bytes) -> None:
        """Decode the request ``data``, stream the engine's outputs, end with END or ERR."""
        try:
            request = self._codec.decode(data)
            timeout = request["timeout"]
            ctx = Context.new(
                request["data"],
                id=str(request["id"]),
                metadata=request["metadata"],
                deadline=None if timeout is None else anyio.current_time() + max(0.0, timeout),
            )
            wire = request.get("wire", 1)
            batching = wire >= 2
            window = request.get("window")
            if batching and window is not None:  # (flow control rides on the batching pump)
                served.limit = max(1, int(window))
                served.retained = deque()
            served.beats_out_of_band = wire >= 3
        except Exception as exc:
            undecodable = EngineError(f"worker {self.worker_id} cannot decode the request: {exc}")
            await self.send(served, _wire.ERR, _wire.error_body(undecodable, ""))
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
        await self.send(served, _wire.START, self.worker_id)
        error: Exception | None = None
        try:
            async with open_stream(self._engine, ctx) as stream:
                if batching:
                    await self._pump(served, stream)
                else:
                    async for item in stream:
                        await self.send(served, DATA, item)
        except Exception as exc:
            error = exc
        if served.gone:
            return
        try:
            await self._flush(served)  # what was held when the stream ended goes first
        except Exception as exc:  # an output that cannot be encoded or is too large
            error = error or exc
        if error is not None:
            if span is not None:
                span.set_error(f"{type(error).__name__}: {error}")
            await self.send(served, _wire.ERR, _wire.error_body(error, request_id))
        elif served.shutdown:
            lost = StreamDisconnected(f"worker {self.worker_id} shut down", request_id=request_id)
            await self.send(served, _wire.ERR, _wire.error_body(lost, request_id))
        elif not ctx.is_killed:  # killed by its deadline: the client gave up at the same time
            await self.send(served, _wire.END, None)

    async def abandon(self, served: Served) -> None:
        """End a stream whose task was cancelled mid-way with an ERR (StreamDisconnected).

        Outputs still held are dropped: the client replays what it received.
        """
        served.held.clear()
        request_id = served.ctx.id if served.ctx is not None else ""
        lost = StreamDisconnected(f"worker {self.worker_id} shut down", request_id=request_id)
        await self.send(served, _wire.ERR, _wire.error_body(lost, request_id))

    async def _pump(self, served: Served, stream: AsyncIterator[Any]) -> None:
        """Move ``stream``'s outputs into batches until it ends (see the module docstring)."""
        held = served.held
        next_item = stream.__anext__

        async def flush() -> None:
            await self._flush(served)

        try:
            first = await next_item()
        except StopAsyncIteration:
            return
        await self.send(served, DATA, first)  # never held: the time to first token is as before
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
                await self._flush(served)

    async def _wait_for_credit(self, served: Served, pulled: int) -> None:
        """The output just pulled is one past the client's credit: send the ones before it,
        then hold it until the client has granted it.

        (Pulling it first means a stream that ends exactly at its credit ends without a
        round trip.) A kill (the client went away, a shutdown) cancels the wait with the
        stream.
        """
        over = served.held.pop()
        await self._flush(served)
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

    async def resume(self, served: Served, next_seq: int | None) -> None:
        """Send what ``served`` held through a bus outage, in order, then stream as before.

        Called when its client pinged it: the client is connected and subscribed again,
        and expects frame ``next_seq`` next (None: a client that does not say). The frames
        from there that were sent and lost go out again first; frames produced meanwhile
        are parked behind the ones being sent.
        """
        frames = served.parked
        if frames is None or served.resuming:
            return
        served.resuming = True
        try:
            if next_seq is not None and served.retained:
                served.acknowledge(next_seq)
                for _, data in list(served.retained):
                    if not await self._publish(served, data):
                        return
            while frames and not served.gone:
                seq, data = frames[0]
                if not await self._publish(served, data):
                    return
                del frames[0]
                if served.retained is not None:
                    served.retained.append((seq, data))
            served.unpark()
        finally:
            served.resuming = False

    async def _publish(self, served: Served, data: bytes) -> bool:
        """Publish one frame of ``served``; False (and the client is gone) when it fails."""
        nc = self.nc
        if nc is None or served.gone:
            return False
        try:
            await nc.publish(served.inbox, data, reply=served.reply)
        except nats.errors.Error as exc:
            logger.warning("worker %s cannot reach its client: %r", self.worker_id, exc)
            self.client_gone(served)
            return False
        return True

    async def heartbeat(self, served: Served) -> None:
        """Tell a quiet stream's client that the worker is alive (and learn if it is not)."""
        nc = self.nc
        if served.parked is not None:
            return  # its client will ping it once it is back
        if not served.beats_out_of_band:
            await self.send(served, _wire.HB, None)
        elif not served.gone and nc is not None:
            self.messages += 1
            try:
                # Published with the reply subject like a frame: a vanished client is
                # noticed by its "no responders" (NatsWorker._on_gone).
                await nc.publish(served.inbox, b"", reply=served.reply, headers=_HEARTBEAT_HEADERS)
            except nats.errors.Error as exc:
                logger.warning("worker %s cannot reach its client: %r", self.worker_id, exc)
                self.client_gone(served)

    async def _flush(self, served: Served) -> None:
        """Send the outputs ``served`` holds, in one message."""
        if served.held:
            items = served.held.copy()
            served.held.clear()
            await self._send_outputs(served, items)

    async def _send_outputs(self, served: Served, items: list[Any]) -> None:
        if len(items) == 1:
            await self.send(served, DATA, items[0])
        else:
            await self.send(served, BATCH, items)

    async def send(self, served: Served, kind: int, body: Any) -> None:
        """Publish one frame; a client that is gone (or unreachable) gets nothing more.

        Raises:
            EngineError: when an output cannot be encoded or is too large for NATS.
        """
        nc = self.nc
        if served.gone or nc is None:
            return
        try:
            data = self._codec.encode([served.seq, kind, body])
        except Exception as exc:
            if kind == BATCH:
                await self._send_encodable_prefix(served, body)
            raise EngineError(
                f"worker {self.worker_id} cannot encode a {type(body).__name__} output: {exc}"
            ) from exc
        outputs = 1 if kind == DATA else len(body) if kind == BATCH else 0
        if served.parked is not None or not nc.is_connected:
            if len(data) > nc.max_payload:
                await self._too_large(served, kind, body, len(data))
                return
            served.park()
            if served.parked is not None:
                served.parked.append((served.seq, data))
                served.seq += 1
                self.messages += 1
                self.outputs += outputs
            return
        # Counted before the publish, which may suspend: the client can have the message
        # before this task runs again.
        seq = served.seq
        served.seq += 1
        self.messages += 1
        self.outputs += outputs
        if served.retained is not None:
            served.retained.append((seq, data))
        try:
            # The reply subject is how a vanished client is noticed: NATS answers a publish
            # nobody receives with "no responders" there (NatsWorker._on_gone).
            await nc.publish(served.inbox, data, reply=served.reply)
        except nats.errors.MaxPayloadError:
            if served.retained:
                served.retained.pop()
            # Nothing was sent (the size is checked before anything is queued, so nothing
            # else could send meanwhile either).
            served.seq -= 1
            self.messages -= 1
            self.outputs -= outputs
            await self._too_large(served, kind, body, len(data))
        except nats.errors.Error as exc:
            logger.warning("worker %s cannot reach its client: %r", self.worker_id, exc)
            self.client_gone(served)

    async def _too_large(self, served: Served, kind: int, body: Any, size: int) -> None:
        """A frame over the server's payload limit: a batch goes out in halves.

        Raises:
            EngineError: for one output that is too large on its own.
        """
        if kind == BATCH:
            half = len(body) // 2
            await self._send_outputs(served, body[:half])
            await self._send_outputs(served, body[half:])
            return
        raise EngineError(f"a {type(body).__name__} output of {size} bytes is over the NATS limit")

    async def _send_encodable_prefix(self, served: Served, items: list[Any]) -> None:
        """A batch failed to encode: send the outputs before the first bad one, then raise.

        Raises:
            EngineError: naming the output that cannot be encoded.
        """
        for index, item in enumerate(items):
            try:
                self._codec.encode(item)
            except Exception as exc:
                if index:
                    await self._send_outputs(served, items[:index])
                raise EngineError(
                    f"worker {self.worker_id} cannot encode a {type(item).__name__} output: {exc}"
                ) from exc
