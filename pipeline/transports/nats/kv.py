"""KV events over NATS: :class:`NatsKvPublisher` (worker) and :class:`NatsKvEvents` (frontend).

A KV router needs to know which prompt blocks each worker caches; the workers know, in
another process. Subjects (``ns`` the namespace, ``model`` escaped as in :mod:`.wire`)::

    {ns}.kv.{model}.{worker_id}             events: {"worker", "events": [event dict, ...],
                                            "load": WorkerLoad dict (optional)}
    {ns}.kv.{model}.{worker_id}.snapshot    request/reply: the worker's KvSnapshot dict

Events are plain publishes, not a queue group: every frontend of the model subscribes to
``{ns}.kv.{model}.*`` and keeps its own :class:`~pipeline.prefix_index.PrefixIndex`.
Nothing is persisted: an event a frontend missed (it started late, NATS restarted, the
worker's buffer overflowed) shows as a gap in the worker's numbering, and the worker's
snapshot (which carries the number of the last event it reflects) repairs it. So the
frontend asks for a snapshot when a worker joins its WorkerSet, when the index reports
a gap, and for every member after its connection was re-established; and it drops a
worker's blocks the moment the worker leaves the set (a graceful stop, eviction at the
first "no responders", or an expired key), through :meth:`WorkerSet.listen`.

The engine's sink is synchronous and runs on the engine's path, so the publisher only
appends to a bounded buffer there; a task publishes what is buffered, the events ready
together in one message.

**Load reports ride along.** A worker whose engine reports its load (``load_report()``,
:class:`pipeline.WorkerLoad`) adds it to each message, and sends it alone when it changed
and no event went for :data:`LOAD_INTERVAL` (an engine without KV events too); the
frontend keeps each member's last one, stamped when it arrived, for its KV router
(:meth:`NatsKvEvents.load_report`). Lost like any message: the next one replaces it.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol, final

import anyio
import nats.errors
from anyio.abc import TaskStatus

from pipeline.kv_events import KvEvent, KvEventSink, KvSnapshot, event_from_dict
from pipeline.worker_load import WorkerLoad

from . import wire
from .connection import quietly, settle
from .wire import DEFAULT_NAMESPACE, control_codec

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from pipeline.prefix_index import PrefixIndex
    from pipeline.routers import Worker, WorkerSet

__all__ = (
    "LOAD_INTERVAL",
    "KvReporter",
    "NatsKvEvents",
    "NatsKvEventsStatistics",
    "NatsKvPublisher",
    "NatsKvPublisherStatistics",
    "kv_subject",
)

logger = logging.getLogger(__name__)

#: events a worker buffers while publishing lags; beyond, the oldest are dropped (the
#: frontends see a gap and ask for a snapshot)
MAX_BUFFERED: Final = 1 << 14
#: events per message at most (a message costs more than an event's bytes)
_MAX_BATCH: Final = 64
#: how often a frontend looks for a reconnection (after which it asks for snapshots)
_RECONNECT_POLL: Final = 0.25
#: seconds at most between a load that changed and the message that says it
LOAD_INTERVAL: Final = 0.05
#: a snapshot request: its timeout, and how often it is retried (a worker reconnecting)
_SNAPSHOT_TIMEOUT: Final = 1.0
_SNAPSHOT_ATTEMPTS: Final = 8


def kv_subject(model: str, worker_id: str = "*", namespace: str = DEFAULT_NAMESPACE) -> str:
    """The subject ``worker_id`` publishes ``model``'s KV events on (``*``: every worker's)."""
    wire.Subjects(namespace)  # checks the namespace
    return f"{namespace}.kv.{wire.escape_token(model)}.{worker_id}"


class KvReporter(Protocol):
    """An engine that reports its prefix cache (the mocker, the llama engine)."""

    #: the sink of its KV events; an engine whose cache is off leaves it None when set
    kv_events: KvEventSink | None

    def kv_snapshot(self) -> KvSnapshot:
        """Every block it holds, as of its last event."""
        ...


class NatsKvPublisherStatistics(NamedTuple):
    """A snapshot of a publisher, from :meth:`NatsKvPublisher.statistics`."""

    events: int  #: events published
    messages: int  #: messages they took
    dropped: int  #: events dropped (buffer full, or a failed publish)
    snapshots: int  #: snapshot requests answered


@final
class NatsKvPublisher:
    """Publishes an engine's KV events for ``model``'s frontends, and answers their
    snapshot requests, until cancelled: ``await task_group.start(publisher.run)``.

    Start it before the worker registers (its snapshot subject is then subscribed when a
    frontend first hears of the worker) and with the worker's id. ``active`` is False when
    the engine took no sink (its cache is off): then no event is published and no snapshot
    answered, only its load reports (if it makes any).
    """

    def __init__(
        self,
        engine: KvReporter,
        *,
        nc: Client,
        model: str,
        worker_id: str,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        self.engine = engine
        self.worker_id = wire.check_token("worker_id", worker_id)
        #: where the events go
        self.subject = kv_subject(model, self.worker_id, namespace)
        #: where frontends ask for a snapshot
        self.snapshot_subject = f"{self.subject}.snapshot"
        self.active = False
        self._nc = nc
        self._buffer: deque[KvEvent] = deque()
        self._ready = anyio.Event()
        load = getattr(engine, "load_report", None)
        self._load: Callable[[], WorkerLoad | None] | None = load if callable(load) else None
        self._said: dict[str, Any] | None = None  # the last load published
        self._events = self._messages = self._dropped = self._snapshots = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Publish until cancelled; ``task_status`` is told once snapshots are answered."""
        self.engine.kv_events = self._on_event
        self.active = self.engine.kv_events is not None
        if not self.active:
            logger.info("worker %s: the engine reports no KV events", self.worker_id)
            if self._load is None:
                task_status.started()
                return
        subscription = None
        if self.active:
            subscription = await self._nc.subscribe(self.snapshot_subject, cb=self._on_request)
        try:
            await settle(self._nc)
            task_status.started()
            while True:
                with anyio.move_on_after(math.inf if self._load is None else LOAD_INTERVAL):
                    await self._ready.wait()
                self._ready = anyio.Event()
                await self._publish_buffered()
        finally:
            if self.engine.kv_events == self._on_event:
                self.engine.kv_events = None
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await self._publish_buffered()
                if subscription is not None:
                    await quietly(subscription.unsubscribe)

    def statistics(self) -> NatsKvPublisherStatistics:
        """Events and messages published, dropped, and snapshots answered."""
        return NatsKvPublisherStatistics(
            self._events, self._messages, self._dropped, self._snapshots
        )

    def _on_event(self, event: KvEvent) -> None:
        # The engine's path: no I/O here, only the buffer.
        if len(self._buffer) >= MAX_BUFFERED:
            self._buffer.popleft()
            self._dropped += 1
        self._buffer.append(event)
        self._ready.set()

    async def _publish_buffered(self) -> None:
        buffer = self._buffer
        load = self._load_now()  # (when it changed: alone if no event goes)
        while buffer or load is not None:
            batch = [buffer.popleft().to_dict() for _ in range(min(len(buffer), _MAX_BATCH))]
            message: dict[str, Any] = {"worker": self.worker_id, "events": batch}
            if not buffer and load is not None:  # with the last batch: the newest word
                message["load"], load = load, None
            try:
                data = control_codec.encode(message)
                if len(data) > self._nc.max_payload:
                    raise ValueError(f"{len(data)} bytes, over the NATS payload limit")
                await self._nc.publish(self.subject, data)
            except (nats.errors.Error, ValueError, TypeError) as exc:
                # Lost like any other message: the frontends' next gap asks for a snapshot.
                logger.warning("worker %s: KV events not published: %r", self.worker_id, exc)
                self._dropped += len(batch)
                continue
            self._events += len(batch)
            self._messages += 1

    def _load_now(self) -> dict[str, Any] | None:
        """The engine's load now, if it changed since the last one published."""
        if self._load is None:
            return None
        report = self._load()
        plain = None if report is None else report.to_dict()
        if plain is None or plain == self._said:
            return None
        self._said = plain
        return plain

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        answer = {"worker": self.worker_id, **self.engine.kv_snapshot().to_dict()}
        data = control_codec.encode(answer)
        if len(data) > self._nc.max_payload:
            logger.warning("worker %s: KV snapshot over the payload limit", self.worker_id)
            data = control_codec.encode({"worker": self.worker_id, "error": "too large"})
        self._snapshots += 1
        await quietly(self._nc.publish, msg.reply, data)

    def __repr__(self) -> str:
        return f"NatsKvPublisher({self.worker_id!r}, {self.subject!r})"


class NatsKvEventsStatistics(NamedTuple):
    """A snapshot of a frontend's KV feed, from :meth:`NatsKvEvents.statistics`."""

    events: int  #: events applied
    snapshots: int  #: snapshots applied
    requests: int  #: snapshot requests sent (joins, gaps, reconnections, retries)
    ignored: int  #: events from workers not (or no longer) in the WorkerSet


@final
class NatsKvEvents:
    """Feeds ``index`` from the KV events ``model``'s workers publish, for the members of
    a WorkerSet: ``await task_group.start(kv_events.run, worker_set)``.

    Only members count: events of a worker not in the set (not yet discovered, or gone)
    are ignored, a worker that joins is asked for its snapshot, and one that leaves is
    dropped from the index at once. A gap in a worker's events, and a reconnection (the
    events published meanwhile are lost), ask for snapshots too. The load reports that ride
    along are kept per member (:meth:`load_report`: a KV router's ``report``).
    """

    def __init__(
        self,
        nc: Client,
        *,
        model: str,
        index: PrefixIndex,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        self.model = model
        #: the index this feed keeps current
        self.index = index
        self._nc = nc
        self._subject = kv_subject(model, "*", namespace)
        self._namespace = namespace
        self._workers: WorkerSet[Any, Any] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._asking: set[str] = set()
        self._silent: set[str] = set()  # workers told to have no KV events (logged once)
        self._loads: dict[str, WorkerLoad] = {}  # each member's last load report
        self._events = self._snapshots = self._requests = self._ignored = 0

    async def run(
        self,
        workers: WorkerSet[Any, Any],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Follow ``workers``' KV events until cancelled; ``task_status`` is told once the
        subscription is active and the current members were asked for snapshots."""
        self._workers = workers
        async with anyio.create_task_group() as tg:
            self._tg = tg
            stop_listening = workers.listen(self._on_membership)
            subscription = await self._nc.subscribe(self._subject, cb=self._on_message)
            try:
                await settle(self._nc)
                for worker in workers.members:
                    self._ask(worker.id)
                task_status.started()
                await self._resync_after_reconnections(workers)
            finally:
                stop_listening()
                self._tg = None
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    await quietly(subscription.unsubscribe)
                tg.cancel_scope.cancel()

    async def _resync_after_reconnections(self, workers: WorkerSet[Any, Any]) -> None:
        """Ask every member for its snapshot after each reconnection (events were lost)."""
        nc = self._nc
        reconnects = nc.stats["reconnects"]
        while True:
            await anyio.sleep(_RECONNECT_POLL)
            if nc.stats["reconnects"] != reconnects and nc.is_connected:
                reconnects = nc.stats["reconnects"]
                logger.info("KV events of %s: reconnected, asking for snapshots", self.model)
                for worker in workers.members:
                    self._ask(worker.id)

    def statistics(self) -> NatsKvEventsStatistics:
        """Events and snapshots applied, snapshot requests sent, events ignored."""
        return NatsKvEventsStatistics(self._events, self._snapshots, self._requests, self._ignored)

    def _is_member(self, worker_id: str) -> bool:
        return self._workers is not None and worker_id in self._workers

    def _on_membership(self, worker_id: str, joined: bool) -> None:
        if joined:
            self._ask(worker_id)
        else:
            self.index.remove_worker(worker_id)
            self._loads.pop(worker_id, None)

    def load_report(self, worker: Worker[Any, Any]) -> WorkerLoad | None:
        """``worker``'s last load report, stamped when it arrived (None: none heard)."""
        return self._loads.get(worker.id)

    async def _on_message(self, msg: Msg) -> None:
        try:
            body = control_codec.decode(msg.data)
            worker_id = str(body["worker"])
            events = [event_from_dict(plain) for plain in body["events"]]
            plain = body.get("load")
            load = None if plain is None else WorkerLoad.from_dict(plain, anyio.current_time())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("KV events of %s: malformed message: %r", self.model, exc)
            return
        if not self._is_member(worker_id):
            self._ignored += len(events)
            return
        if load is not None:
            self._loads[worker_id] = load
        in_order = True
        for event in events:
            in_order = self.index.apply(worker_id, event) and in_order
        self._events += len(events)
        if not in_order:
            self._ask(worker_id)

    def _ask(self, worker_id: str) -> None:
        """Ask ``worker_id`` for its snapshot, unless a request for it is under way."""
        if worker_id in self._asking or self._tg is None:
            return
        self._asking.add(worker_id)
        self._tg.start_soon(self._request_snapshot, worker_id)

    async def _request_snapshot(self, worker_id: str) -> None:
        subject = f"{kv_subject(self.model, worker_id, self._namespace)}.snapshot"
        delay = 0.05
        try:
            for attempt in range(_SNAPSHOT_ATTEMPTS):
                if not self._is_member(worker_id):
                    return
                self._requests += 1
                try:
                    reply = await self._nc.request(subject, b"", timeout=_SNAPSHOT_TIMEOUT)
                    body = control_codec.decode(reply.data)
                    if "error" in body:
                        logger.warning("KV snapshot of %s: %s", worker_id, body["error"])
                        return
                    snapshot = event_from_dict(body)
                except nats.errors.NoRespondersError:
                    pass  # its cache is off, or it is reconnecting: try again a few times
                except (nats.errors.Error, ValueError, KeyError, TypeError) as exc:
                    logger.debug("KV snapshot of %s (attempt %d): %r", worker_id, attempt, exc)
                else:
                    if not self._is_member(worker_id):
                        return
                    if not isinstance(snapshot, KvSnapshot):
                        logger.warning("KV snapshot of %s: got %r", worker_id, body)
                        return
                    self._snapshots += 1
                    if self.index.apply(worker_id, snapshot):
                        return
                    continue  # the snapshot left a gap (events dropped meanwhile): again
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
            if worker_id not in self._silent:
                self._silent.add(worker_id)
                logger.info(
                    "KV events of %s: worker %s sends no snapshot: it reports no KV events "
                    "(routed by load alone) or is unreachable",
                    self.model,
                    worker_id,
                )
        finally:
            self._asking.discard(worker_id)

    def __repr__(self) -> str:
        return f"NatsKvEvents(model={self.model!r}, {self.index!r})"
