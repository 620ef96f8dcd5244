"""The worker half of the NATS transport: :func:`serve`, :class:`NatsWorker`.

The transport as a whole is described in :mod:`pipeline.transports.nats`.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar, final

import anyio
from anyio.abc import TaskStatus

from pipeline.transports.codec import Codec, MsgpackCodec

from . import wire
from .bucket import DEFAULT_BUCKET, jetstream_unavailable, open_bucket
from .bus import bus_of
from .connection import connect, quietly, settle
from .keeper import Keeper
from .outbox import Outbox, Served
from .registration import Registration
from .serving import StreamServer
from .wire import DEFAULT_NAMESPACE, NatsTimeouts

if TYPE_CHECKING:
    from types import TracebackType

    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

    from pipeline.operator import Engine
    from pipeline.tracing import Tracer

    from .client import Coalesce

__all__ = ("NatsWorker", "NatsWorkerStatistics", "serve")

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")

#: how long a deregistered worker still takes requests, for routers that picked it just before
_DEREGISTER_GRACE = 0.1


class NatsWorkerStatistics(NamedTuple):
    """A snapshot of a worker, from :meth:`NatsWorker.statistics`."""

    in_flight: int  #: requests being served now
    requests: int  #: requests accepted since the worker started
    clients_gone: int  #: requests cut short because the client cancelled or vanished
    messages: int  #: stream messages published (START, DATA, BATCH, END, ERR, heartbeats)
    outputs: int  #: outputs published (one per DATA, several per BATCH)
    paused: int  #: streams waiting for their client's credit now (flow control)
    pauses: int  #: times a stream waited for its client's credit


@final
class NatsWorker(Generic[In, Out]):
    """Serves an Engine to other processes over NATS (build it with :func:`serve`).

    Use it as an async context manager, or run it in a task group::

        async with serve(engine, nc=nc, model="smollm2") as worker:
            await worker.serve_forever()          # until worker.stop()

        await task_group.start(serve(engine, url=url, model="smollm2").run)

    Entering subscribes and registers the worker for discovery; a normal exit (after
    :meth:`stop`, or a DRAIN control message: :func:`~.drain.drain_worker`) is a graceful
    shutdown: deregister, stop taking requests, let in-flight
    ones finish for up to ``timeouts.drain`` seconds, then cut off the rest. Exiting by an
    exception or cancellation (a drain cut short) skips the wait. Either way every stream
    cut off ends with an ERR frame (StreamDisconnected), so its client migrates it at once
    instead of noticing the silence at its next idle ping. Pass ``nc`` (a connected
    client, left open) or ``url`` (connected and closed here). ``register=False`` serves
    without discovery (no JetStream needed). ``tracer`` traces every request served
    (:mod:`pipeline.tracing`): a span ``worker`` from its arrival, under the client's span
    when the request carries a ``traceparent``, and the engine's below it. ``coalesce``
    merges the outputs of each batch for clients that read wire version 4 (the LLM layer
    gives ``operators.contracts.transport.coalesce_outputs``: token outputs into bursts).
    """

    def __init__(
        self,
        engine: Engine[In, Out],
        *,
        nc: Client | None = None,
        url: str | None = None,
        model: str,
        role: str = "aggregated",
        worker_id: str | None = None,
        codec: Codec | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        bucket: str = DEFAULT_BUCKET,
        timeouts: NatsTimeouts | None = None,
        register: bool = True,
        tracer: Tracer | None = None,
        coalesce: Coalesce | None = None,
    ) -> None:
        if (nc is None) == (url is None):
            raise ValueError("pass exactly one of nc= (a connected client) or url=")
        self._nc_given = nc
        self._url = url
        self.model = model
        self.role = wire.check_role(role)
        self.worker_id = wire.check_token(
            "worker_id", worker_id if worker_id is not None else uuid.uuid4().hex
        )
        subjects = wire.Subjects(namespace)
        #: where direct requests for this worker go
        self.subject = subjects.worker(self.worker_id)
        #: where stop, kill and pings for this worker go
        self.control_subject = subjects.control(self.worker_id)
        #: the model's load-balanced subject (and queue group)
        self.model_subject = subjects.model(model, self.role)
        self._outbox = Outbox(
            codec if codec is not None else MsgpackCodec(), self.worker_id, coalesce
        )
        self._streams: StreamServer[In, Out] = StreamServer(engine, self._outbox, tracer)
        self._bucket = bucket
        self._timeouts = timeouts if timeouts is not None else NatsTimeouts()
        self._registration = Registration(
            bucket,
            f"{wire.escape_token(model)}.{self.role}.{self.worker_id}",
            {
                "id": self.worker_id,
                "subject": self.subject,
                "control": self.control_subject,
                "model": self.model,
                "role": self.role,
            },
            ttl=self._timeouts.ttl,
        )
        self._register = register
        self._nc: Client | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stopping: anyio.Event | None = None
        self._drained: anyio.Event | None = None
        self._keeper = Keeper(self._outbox, self._timeouts, self._drain_asked)
        #: the streams being served, by their client's inbox (the keeper's)
        self._served = self._keeper.served
        self._tokens = itertools.count()
        self._by_reply = self._keeper.by_reply
        self._gone_prefix = ""
        self._requests = 0
        self._stop_requested = False
        self._deregistered = False
        self._closed_subjects: set[str] = set()
        self._cm: AbstractAsyncContextManager[NatsWorker[In, Out]] | None = None
        self._js: JetStreamContext | None = None  # while registered

    # -- lifecycle

    async def __aenter__(self) -> NatsWorker[In, Out]:
        if self._cm is not None:
            raise RuntimeError(f"{self!r} is already serving; a worker serves once")
        self._cm = self._serving()
        return await self._cm.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._cm is not None, "__aexit__ without __aenter__"
        return await self._cm.__aexit__(exc_type, exc, tb)

    async def run(
        self, *, task_status: TaskStatus[NatsWorker[In, Out]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until :meth:`stop`, then shut down gracefully; ``task_status`` gets the worker."""
        async with self:
            task_status.started(self)
            await self.serve_forever()

    async def serve_forever(self) -> None:
        """Wait until :meth:`stop` is called (or the caller is cancelled)."""
        if self._stopping is None:
            raise RuntimeError("serve_forever() runs inside `async with worker:`")
        await self._stopping.wait()

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return, so the worker shuts down gracefully."""
        self._stop_requested = True
        if self._stopping is not None:
            self._stopping.set()

    def _drain_asked(self) -> None:
        """A DRAIN control message: deregister and drain, as :meth:`stop` does."""
        if not self._stop_requested:
            logger.info(
                "worker %s asked to drain: deregisters and drains %d requests (up to %gs)",
                self.worker_id,
                len(self._served),
                self._timeouts.drain,
            )
        self.stop()

    def set_ready(self, ready: bool, reason: str | None = None) -> None:
        """Tell discovery whether this worker takes requests (its engine's health,
        :mod:`pipeline.health`): one that is not stays registered and its streams go on,
        but frontends route new requests elsewhere until it is ready again. Announced at
        once while serving, else with the registration."""
        if self._registration.set_ready(ready, reason) and self._tg is not None:
            js = self._js
            if js is not None and not self._deregistered:
                self._tg.start_soon(self._announce, js)

    async def _announce(self, js: JetStreamContext) -> None:
        try:
            await self._registration.announce(js)
        except Exception as exc:  # nats or JetStream API errors: the next refresh says it
            logger.warning("worker %s could not announce its readiness: %r", self.worker_id, exc)

    def statistics(self) -> NatsWorkerStatistics:
        """Requests in flight and served so far."""
        return NatsWorkerStatistics(
            in_flight=len(self._served),
            requests=self._requests,
            clients_gone=self._outbox.clients_gone,
            messages=self._outbox.messages,
            outputs=self._outbox.outputs,
            paused=self._streams.paused,
            pauses=self._streams.pauses,
        )

    @asynccontextmanager
    async def _serving(self) -> AsyncGenerator[NatsWorker[In, Out]]:
        self._stopping = anyio.Event()
        if self._stop_requested:
            self._stopping.set()
        nc = self._nc_given
        if nc is None:
            assert self._url is not None
            nc = await connect(self._url, name=f"llm-pipeline worker {self.worker_id}")
        self._nc = nc
        self._outbox.nc = nc
        self._keeper.nc = nc
        subscriptions: list[Subscription] = []
        try:
            js = nc.jetstream()
            kv = await open_bucket(js, self._bucket, nc=nc) if self._register else None
            self._gone_prefix = nc.new_inbox()
            async with anyio.create_task_group() as tg:
                # The task group exists before the first request can arrive.
                self._tg = self._keeper.tg = tg
                try:
                    for subject, queue, callback in (
                        (self.control_subject, "", self._keeper.on_control),
                        (f"{self._gone_prefix}.*", "", self._keeper.on_gone),
                        (self.model_subject, self.model_subject, self._on_request),
                        (self.subject, "", self._on_request),
                    ):
                        subscriptions.append(await nc.subscribe(subject, queue, cb=callback))
                    await settle(nc)  # subscribed for real before anyone hears of us
                    refresh = anyio.CancelScope()
                    if kv is not None:
                        try:
                            await self._registration.announce(js)
                        except Exception as exc:  # nats and JetStream API errors
                            raise jetstream_unavailable(
                                "register in", self._bucket, exc, nc
                            ) from exc
                        self._js = js
                        tg.start_soon(self._registration.refresh, js, nc, refresh)
                    tg.start_soon(self._keeper.heartbeats)
                    logger.info("worker %s serving %s (%s)", self.worker_id, self.model, self.role)
                    graceful = False
                    try:
                        yield self
                        graceful = True
                    finally:
                        refresh.cancel()
                        try:
                            if graceful:  # cancellable: a second Ctrl-C cuts the drain short
                                await self._shut_down(kv, subscriptions[2:], graceful=True)
                        finally:
                            with anyio.CancelScope(shield=True):
                                await self._shut_down(kv, subscriptions[2:], graceful=False)
                finally:
                    with anyio.CancelScope(shield=True):
                        for subscription in subscriptions:
                            await quietly(subscription.unsubscribe)
                    tg.cancel_scope.cancel()
        finally:
            self._tg = self._keeper.tg = None
            if self._nc_given is None:
                with anyio.CancelScope(shield=True):
                    await quietly(nc.close)
            stats = self.statistics()
            logger.info(
                "worker %s stopped after %d requests: %d outputs in %d messages",
                self.worker_id,
                stats.requests,
                stats.outputs,
                stats.messages,
            )

    async def _shut_down(
        self, kv: KeyValue | None, requests: list[Subscription], *, graceful: bool
    ) -> None:
        """Deregister, stop taking requests, drain (when graceful), cut off the rest.

        Safe to call again (after a graceful drain was cancelled): it does what is left.
        """
        if kv is not None and not self._deregistered:
            self._deregistered = True
            await self._registration.withdraw(kv)
            if graceful:
                # Routers that picked us just before they saw the deletion still reach us.
                await anyio.sleep(_DEREGISTER_GRACE)
        for subscription in requests:
            if subscription.subject not in self._closed_subjects:
                self._closed_subjects.add(subscription.subject)
                with anyio.move_on_after(1.0):
                    # Drain: serve the requests already delivered to us, then take no more.
                    await quietly(subscription.drain if graceful else subscription.unsubscribe)
        if self._served:
            self._drained = anyio.Event()
            if graceful:
                with anyio.move_on_after(self._timeouts.drain):
                    await self._drained.wait()
            for served in self._served.values():
                served.shutdown = True
                served.kill()
            with anyio.move_on_after(1.0):
                await self._drained.wait()

    # -- NATS callbacks (they run in nats-py's tasks: hand work to our task group at once)

    async def _on_request(self, msg: Msg) -> None:
        tg = self._tg
        if tg is None or not msg.reply or msg.reply in self._served:
            logger.warning(
                "worker %s: ignoring a request without a fresh reply inbox", self.worker_id
            )
            return
        served = Served(msg.reply, f"{self._gone_prefix}.{next(self._tokens)}")
        self._served[served.inbox] = served
        self._by_reply[served.reply] = served
        self._requests += 1
        self._keeper.arrived()
        tg.start_soon(self._serve_one, served, msg.data)

    # -- serving one request

    async def _serve_one(self, served: Served, data: bytes) -> None:
        cut_off = True  # until serve() returns or fails: only a cancellation leaves it set
        try:
            await self._streams.serve(served, data)
            cut_off = False
            # Ended while the bus was down: its last frames are parked, and its client
            # asks for them once it is back (forgetting the stream now would answer
            # "unknown", and a stream that cannot migrate would fail). Ended just after
            # our own reconnection: its last frames may have reached no subscriber (the
            # client not back yet; the "no responders" come after the end), so the
            # frames it has not acknowledged are held the same way, for its ping.
            if served.retained and self._nc is not None:
                if not bus_of(self._nc).settled(self._timeouts.settle):
                    served.park()
            await served.wait_unparked()
        except Exception:  # a bug here must not take the other requests down
            cut_off = False
            logger.exception("worker %s failed serving a request", self.worker_id)
        finally:
            if cut_off:
                # Cancelled: a drain cut short (a second signal), or the worker itself
                # cancelled. Its client hears it now, not at its next idle ping.
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    await self._streams.abandon(served)
            del self._served[served.inbox]
            del self._by_reply[served.reply]
            if not self._served and self._drained is not None:
                self._drained.set()

    def __repr__(self) -> str:
        return f"NatsWorker({self.worker_id!r}, model={self.model!r}, role={self.role!r})"


def serve(
    engine: Engine[In, Out],
    *,
    nc: Client | None = None,
    url: str | None = None,
    model: str,
    role: str = "aggregated",
    worker_id: str | None = None,
    codec: Codec | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    bucket: str = DEFAULT_BUCKET,
    timeouts: NatsTimeouts | None = None,
    register: bool = True,
    tracer: Tracer | None = None,
    coalesce: Coalesce | None = None,
) -> NatsWorker[In, Out]:
    """Expose ``engine`` as a NATS worker for ``model`` in ``role``.

    Returns a :class:`NatsWorker` to enter: ``async with serve(engine, nc=nc, model="m") as
    worker: await worker.serve_forever()``, or ``await tg.start(serve(...).run)``.
    """
    return NatsWorker(
        engine,
        nc=nc,
        url=url,
        model=model,
        role=role,
        worker_id=worker_id,
        codec=codec,
        namespace=namespace,
        bucket=bucket,
        timeouts=timeouts,
        register=register,
        tracer=tracer,
        coalesce=coalesce,
    )
