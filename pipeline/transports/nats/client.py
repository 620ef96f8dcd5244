"""The client half of the NATS transport: :class:`RemoteEngine`.

The transport as a whole is described in :mod:`pipeline.transports.nats`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, TypeAlias, TypeVar, final

import anyio
import nats.errors
from nats.aio.msg import Msg

from pipeline.errors import ConnectFailed, EngineError, ResponseTimeout, StreamDisconnected
from pipeline.transports.codec import Codec, MsgpackCodec

from . import wire
from .bus import POLL, bus_of
from .connection import quietly
from .inbox import IDLE, STOPPED, ClientStream, Signal
from .wire import DEFAULT_NAMESPACE, DEFAULT_WINDOW, NatsTimeouts, control_codec

if TYPE_CHECKING:
    from nats.aio.client import Client

    from pipeline.context import Context
    from pipeline.operator import Stream

__all__ = ("RemoteEngine", "RemoteEngineStatistics")

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")

NoResponders: TypeAlias = Callable[[Literal["request", "control"]], None]
"""Told which of a worker's subjects NATS found nobody listening on (see RemoteEngine)."""
Coalesce: TypeAlias = Callable[[list[Any]], list[Any]]
"""Turns the outputs of one batch into fewer, equivalent ones (see RemoteEngine)."""


class RemoteEngineStatistics(NamedTuple):
    """A snapshot of a client engine, from :meth:`RemoteEngine.statistics`."""

    in_flight: int  #: streams open through this engine now
    buffered: int  #: messages received and not read yet, over all of them


@final
class RemoteEngine(Generic[In, Out]):
    """An Engine whose requests are served by a :class:`NatsWorker` in another process.

    ``RemoteEngine(nc, model="m")`` sends each request to whichever worker of model ``m``
    (in ``role``) the NATS queue group picks; ``RemoteEngine(nc, worker_id="w")`` sends it to
    that worker (what :class:`NatsDiscovery` puts in a WorkerSet). ``codec`` must match the
    worker's. ``subject``/``control_subject`` override the names derived from ``namespace``.

    A traced request (``ctx.span``) carries its span's W3C ``traceparent`` in its
    metadata, so that a worker that traces hangs its spans under it.

    The stream raises what the remote engine raised (the same :mod:`pipeline.errors`
    type; anything else as :class:`~pipeline.EngineError`), or:

    * :class:`~pipeline.ConnectFailed` when no worker listens on the subject;
    * :class:`~pipeline.StreamDisconnected` when the worker died mid-stream (a quiet stream
      whose worker no longer answers pings), frames were lost, or :meth:`abort` was called;
    * :class:`~pipeline.ResponseTimeout` when the worker stops answering pings, or no
      worker took a load-balanced request within ``timeouts.start``.

    Flow control: the worker sends at most ``window`` outputs ahead of what this stream's
    consumer has read (the client grants more, half a window at a time, as it reads), so a
    slow consumer holds at most ``window`` outputs here, however fast the worker is.

    ``on_no_responders`` is called, before the stream raises, when NATS answers "no
    responders" for this engine's worker: ``"request"`` when nobody listens on its
    request subject (the worker is gone, or draining before it leaves), ``"control"``
    when nobody listens on its control subject (it is gone, with its streams).
    :class:`NatsDiscovery` evicts the worker from its WorkerSet there, so that a retry
    never goes back to it, whatever the router's policy.

    ``coalesce`` (optional) is given the outputs of each BATCH frame, the outputs the
    worker had ready together, and returns what the stream yields for them: fewer outputs
    that the graph above takes as equivalent (the LLM layer merges consecutive token
    outputs of one choice into one, as a speculative burst is), so that everything above
    the transport handles one item where it had several. A worker given the same function
    merges before it sends (wire version 4), which saves encoding and decoding each output;
    the client merges what an older worker sends. Flow control counts the worker's
    outputs either way.

    Bus outages: while this process's own connection to NATS is down, a silent worker is
    not a dead one. A stream then waits (no ping, no verdict) for up to
    ``timeouts.outage`` seconds, or its deadline; a request waits to be sent. Once the
    connection is back, the stream pings its worker at once (the ping tells a worker that
    held its outputs during the outage to send them), and for ``timeouts.settle`` seconds
    a worker that does not answer, or has no responders, is given time to reconnect too.
    Outputs lost with the connection show as a gap in the frames' sequence: the stream
    fails with StreamDisconnected, and Migration resumes it elsewhere.
    """

    def __init__(
        self,
        nc: Client,
        *,
        model: str | None = None,
        role: str = "aggregated",
        worker_id: str | None = None,
        codec: Codec | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        timeouts: NatsTimeouts | None = None,
        subject: str | None = None,
        control_subject: str | None = None,
        window: int = DEFAULT_WINDOW,
        on_no_responders: NoResponders | None = None,
        coalesce: Coalesce | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 output, got {window}")
        subjects = wire.Subjects(namespace)
        wire.check_role(role)
        if worker_id is not None:
            wire.check_token("worker_id", worker_id)
        if subject is None:
            if worker_id is not None:
                subject = subjects.worker(worker_id)
            elif model is not None:
                subject = subjects.model(model, role)
            else:
                raise ValueError(
                    "RemoteEngine needs model= (load-balanced) or worker_id= (direct routing)"
                )
        if control_subject is None and worker_id is not None:
            control_subject = subjects.control(worker_id)
        self._nc = nc
        self._subjects = subjects
        #: where requests are published
        self.subject = subject
        #: the worker this engine talks to, or None for load-balanced requests
        self.worker_id = worker_id
        self._control = control_subject
        self._on_no_responders = on_no_responders
        self._coalesce = coalesce
        self._window = window
        self._step = max(1, window // 2)  # outputs read between two grants
        self._codec: Codec = codec if codec is not None else MsgpackCodec()
        self._timeouts = timeouts if timeouts is not None else NatsTimeouts()
        self._tick = min(0.05, self._timeouts.idle / 4)
        self._bus = bus_of(nc)
        self._streams: set[ClientStream] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def in_flight(self) -> int:
        """Streams open through this engine now."""
        return len(self._streams)

    def statistics(self) -> RemoteEngineStatistics:
        """Streams in flight, and what they hold that their consumers have not read."""
        return RemoteEngineStatistics(
            in_flight=len(self._streams),
            buffered=sum(stream.buffered for stream in self._streams),
        )

    def abort(self, reason: str) -> None:
        """Fail every in-flight stream with StreamDisconnected(``reason``).

        Discovery calls it when the worker's registration expired: the worker is gone even
        if its streams have not gone quiet yet.
        """
        lost = Signal(reason)
        for stream in self._streams:
            stream.signal(lost)

    async def generate(self, ctx: Context[In], /) -> Stream[Out]:
        """Send ``ctx`` to a worker and stream its outputs back."""
        if ctx.is_stopped:
            return
        nc = self._nc
        codec = self._codec
        deadline = ctx.deadline
        metadata = dict(ctx.metadata)
        span = ctx.span
        if span is not None:  # the worker's spans join the trace, under this one
            metadata["traceparent"] = span.traceparent
            if self.worker_id is not None:
                span.set("llm_pipeline.remote.worker.id", self.worker_id)
        try:
            request = codec.encode(
                {
                    "id": ctx.id,
                    "data": ctx.data,
                    "timeout": None if deadline is None else deadline - anyio.current_time(),
                    "metadata": metadata,
                    "wire": wire.WIRE_VERSION,
                    "window": self._window,
                }
            )
        except Exception as exc:
            raise EngineError(
                f"cannot encode the request for {self.subject}: {exc}", request_id=ctx.id
            ) from exc
        timeouts = self._timeouts
        bus = self._bus
        if not bus.connected:
            # Our own connection is down: a request published now would only wait in
            # nats-py's buffer, and its start timeout would run meanwhile.
            while not bus.connected:
                if ctx.is_stopped:
                    return
                if bus.down_for() >= timeouts.outage:
                    raise ConnectFailed(
                        f"the NATS connection has been down for {timeouts.outage:g}s",
                        request_id=ctx.id,
                    )
                await anyio.sleep(POLL)
        inbox = nc.new_inbox()
        stream = ClientStream(ctx)
        try:
            subscription = await nc.subscribe(inbox, cb=stream.on_msg)
        except nats.errors.Error as exc:
            stream.close()
            raise ConnectFailed(
                f"cannot subscribe to a reply inbox: {exc!r}", request_id=ctx.id
            ) from exc
        self._watch(stream)
        control = self._control
        worker = self.worker_id
        expected = 0  # the next frame's sequence number
        finished = False  # END or ERR arrived: the worker is done with this stream
        stop_sent = False
        window, step = self._window, self._step
        coalesce = self._coalesce
        read = 0  # outputs the consumer has taken
        regrant = step  # ``read`` at which to grant more
        try:
            await self._publish(request, inbox, ctx)
            sent_at = time.monotonic()
            while True:
                msg = await stream.next()
                if isinstance(msg, Signal):
                    if msg is STOPPED:
                        if control is not None and not stop_sent:
                            stop_sent = True
                            await self._send_control(control, ctx, inbox, kill=ctx.is_killed)
                    elif msg is IDLE:
                        stream.idle_pending = False
                        if not bus.connected:
                            # Our own connection is down: the worker's silence says nothing.
                            if bus.down_for() >= timeouts.outage:
                                raise StreamDisconnected(
                                    f"the NATS connection has been down for {timeouts.outage:g}s",
                                    request_id=ctx.id,
                                )
                            continue
                        if (
                            expected == 0
                            and time.monotonic() - sent_at >= timeouts.start
                            and not bus.disturbed_since(sent_at, timeouts.settle)
                        ):
                            raise ResponseTimeout(
                                f"no worker on {self.subject} took the request within "
                                f"{timeouts.start:g}s",
                                request_id=ctx.id,
                            )
                        if (
                            control is not None
                            and await self._ping(control, worker, ctx, inbox, expected) is False
                            and expected > 0
                            and not stream.pending
                        ):
                            # Frames the worker sent before it answered are delivered first,
                            # so an END on its way would be waiting here already.
                            raise StreamDisconnected(
                                f"worker {worker} no longer serves this stream", request_id=ctx.id
                            )
                    else:
                        raise StreamDisconnected(msg.reason, request_id=ctx.id)
                    continue
                data = msg.data
                if not data:
                    if expected == 0 and not bus.settled(timeouts.settle):
                        # Nobody listens yet, just after a reconnection: the worker may not
                        # be back yet. Ask again shortly (nobody received the request).
                        await anyio.sleep(POLL)
                        await self._publish(request, inbox, ctx)
                        continue
                    raise self._status_error(msg, ctx, started=expected > 0)
                try:
                    frame = codec.decode(data)
                    if type(frame) is not list or not (
                        len(frame) == 3 or (len(frame) == 4 and type(frame[3]) is int)
                    ):
                        raise ValueError(f"not a frame: {frame!r:.80}")
                    seq, kind, body = frame[0], frame[1], frame[2]
                except Exception as exc:
                    raise EngineError(
                        f"cannot decode a frame from {worker or self.subject}: {exc}",
                        request_id=ctx.id,
                    ) from exc
                if seq != expected:
                    if seq < expected or (seq > expected and not bus.settled(timeouts.settle)):
                        # A frame sent again after an outage, or one nats-py flushed from
                        # its buffer ahead of a lost one: the worker sends from `expected`
                        # when this stream's next ping tells it to.
                        continue
                    raise StreamDisconnected(
                        f"frames from worker {worker} were lost (expected #{expected}, got #{seq})",
                        request_id=ctx.id,
                    )
                expected += 1
                if kind == wire.DATA or kind == wire.BATCH:
                    if ctx.is_stopped:
                        # Asked to stop: what the worker sent before it heard is not wanted
                        # (as a local engine would yield nothing more); tell it now, not at
                        # the next timer tick, and read on to its END.
                        if control is not None and not stop_sent:
                            stop_sent = True
                            await self._send_control(control, ctx, inbox, kill=ctx.is_killed)
                    elif kind == wire.DATA:
                        yield body
                    else:
                        # Merged by the worker (wire 4: the count of outputs follows), or
                        # here (an older worker's batch).
                        if coalesce is not None and len(frame) == 3:
                            body = coalesce(body)
                        for item in body:
                            yield item
                            if ctx.is_stopped:
                                break
                    if kind == wire.DATA:
                        read += 1
                    else:
                        read += frame[3] if len(frame) > 3 else len(frame[2])
                elif kind == wire.START:
                    worker = str(body)
                    if control is None:
                        control = self._subjects.control(worker)
                    if ctx.is_stopped and not stop_sent:
                        stop_sent = True
                        await self._send_control(control, ctx, inbox, kill=ctx.is_killed)
                elif kind == wire.END:
                    finished = True
                    return
                elif kind == wire.ERR:
                    finished = True
                    raise wire.error_from_body(body, ctx.id)
                elif kind != wire.HB:
                    raise StreamDisconnected(
                        f"unknown frame kind {kind!r} from worker {worker}", request_id=ctx.id
                    )
                if read >= regrant and control is not None:
                    # The consumer read half a window: let the worker run a window ahead.
                    regrant = read + step
                    credit = control_codec.encode([wire.CREDIT, read + window, expected, inbox])
                    await quietly(nc.publish, control, credit)
        finally:
            self._unwatch(stream)
            stream.close()
            with anyio.CancelScope(shield=True):
                await quietly(subscription.unsubscribe)
                if not finished and control is not None:
                    # The consumer went away (closed the stream, was killed or failed):
                    # the worker must stop now rather than at its next frame.
                    await self._send_control(control, ctx, inbox, kill=True)

    async def _publish(self, request: bytes, inbox: str, ctx: Context[Any]) -> None:
        try:
            await self._nc.publish(self.subject, request, reply=inbox)
        except nats.errors.Error as exc:
            raise ConnectFailed(
                f"cannot send the request to {self.subject}: {exc!r}", request_id=ctx.id
            ) from exc

    def _status_error(self, msg: Msg, ctx: Context[Any], *, started: bool) -> Exception:
        status = (msg.headers or {}).get("Status")
        if status == "503" and not started:
            if self._on_no_responders is not None:
                self._on_no_responders("request")
            return ConnectFailed(f"no worker is listening on {self.subject}", request_id=ctx.id)
        return StreamDisconnected(
            f"unexpected status {status!r} on the reply inbox of {self.subject}",
            request_id=ctx.id,
        )

    async def _ping(
        self, control: str, worker: str | None, ctx: Context[Any], inbox: str, expected: int
    ) -> bool | None:
        """Ask a quiet stream's worker whether it still serves the stream (None: no
        verdict, because the bus went down or came back meanwhile, or only just did).

        ``expected`` is the next frame's sequence number: after an outage, the worker
        sends again from there.

        Raises:
            ConnectFailed: (before the stream started) or
            StreamDisconnected: (after) when the worker is gone.
            ResponseTimeout: when it does not answer in time.
        """
        sent = time.monotonic()
        try:
            reply = await self._nc.request(
                control,
                control_codec.encode([wire.PING, inbox, expected]),
                timeout=self._timeouts.ping,
            )
        except nats.errors.Error as exc:
            if self._bus.disturbed_since(sent, self._timeouts.settle):
                return None  # the worker may be reconnecting, like us
            raise self._ping_error(exc, worker, ctx, control, expected > 0) from exc
        return reply.data == wire.KNOWN

    def _ping_error(
        self,
        exc: nats.errors.Error,
        worker: str | None,
        ctx: Context[Any],
        control: str,
        started: bool,
    ) -> Exception:
        """What a failed ping says of the worker."""
        if isinstance(exc, nats.errors.NoRespondersError):
            if self._on_no_responders is not None and control == self._control:
                self._on_no_responders("control")
            cls = StreamDisconnected if started else ConnectFailed
            return cls(
                f"worker {worker} is gone (its control subject has no responders)",
                request_id=ctx.id,
            )
        if isinstance(exc, nats.errors.TimeoutError):
            return ResponseTimeout(
                f"worker {worker} did not answer a liveness ping within {self._timeouts.ping:g}s",
                request_id=ctx.id,
            )
        return StreamDisconnected(f"cannot reach worker {worker}: {exc!r}", request_id=ctx.id)

    async def _send_control(
        self, control: str, ctx: Context[Any], inbox: str, *, kill: bool
    ) -> None:
        op = wire.KILL if kill else wire.STOP
        await quietly(self._nc.publish, control, control_codec.encode([op, ctx.id, inbox]))

    def _watch(self, stream: ClientStream) -> None:
        self._streams.add(stream)
        if self._timer is None:
            self._loop = asyncio.get_running_loop()
            self._timer = self._loop.call_later(self._tick, self._on_tick)

    def _unwatch(self, stream: ClientStream) -> None:
        self._streams.discard(stream)
        if not self._streams and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_tick(self) -> None:
        # One timer per engine, not a task or a cancel scope per stream: each stream's idle
        # clock is a tick count, and a stream is only woken when it has been quiet too long.
        interval, idle = self._tick, self._timeouts.idle
        for stream in self._streams:
            stream.tick(interval, idle)
        if self._streams and self._loop is not None:
            self._timer = self._loop.call_later(interval, self._on_tick)
        else:
            self._timer = None

    def __repr__(self) -> str:
        return f"RemoteEngine({self.subject!r})"
