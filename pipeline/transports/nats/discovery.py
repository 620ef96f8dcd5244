"""Discovery over NATS JetStream KV: :class:`NatsDiscovery`.

A follower of the discovery bucket (:func:`~.watch.watch_bucket`): each registration
under ``<model>.<role>.*`` becomes a :class:`~.client.RemoteEngine` in a WorkerSet. The
transport as a whole is described in :mod:`pipeline.transports.nats`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, final

import anyio
from anyio.abc import TaskStatus

from . import wire
from .bucket import DEFAULT_BUCKET, JetStreamUnavailable
from .bus import bus_of
from .client import Coalesce, RemoteEngine
from .watch import watch_bucket
from .wire import DEFAULT_NAMESPACE, DEFAULT_WINDOW, NatsTimeouts

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.kv import KeyValue

    from pipeline.routers import WorkerSet
    from pipeline.transports.codec import Codec

__all__ = ("NatsDiscovery",)

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


@final
class _Registry(Generic[In, Out]):
    """What one :meth:`NatsDiscovery.run` put in its WorkerSet, and whom it evicted."""

    __slots__ = ("evicted", "known", "present", "timer", "unconfirmed", "unready", "workers")

    def __init__(self, workers: WorkerSet[In, Out]) -> None:
        self.workers = workers
        #: worker id -> (its registration as last seen, that entry's revision, its engine)
        self.known: dict[str, tuple[bytes, int, RemoteEngine[In, Out]]] = {}
        #: worker id -> the revision of its registration when it was evicted: that entry,
        #: replayed after a reconnection, must not bring it back; a newer one (the worker
        #: refreshed it, so it is alive) does
        self.evicted: dict[str, int] = {}
        #: worker id -> when (time.monotonic) to declare it lost: its registration went
        #: missing or expired around a NATS outage, when a live worker could not refresh
        #: it either; registering again before then confirms it
        self.unconfirmed: dict[str, float] = {}
        #: when the first of them is due (a timer, not a poll: idle, nothing wakes)
        self.timer: asyncio.TimerHandle | None = None
        #: the ids the current watch's replay has shown registered so far; None once the
        #: replay is complete
        self.present: set[str] | None = None
        #: registered workers that say they are not ready (left out of the set), why, and
        #: whether they served before (a new worker waiting for its first probe has not)
        self.unready: dict[str, tuple[str, bool]] = {}

    def watching(self) -> None:
        """A watch begins: its replay is the bucket as it stands."""
        self.present = set()


@final
class NatsDiscovery(Generic[In, Out]):
    """Keeps WorkerSets in step with the workers registered for one model and role.

    Each worker's key holds ``{id, subject, control, model, role}``; a new key adds a
    :class:`RemoteEngine` for it, a deleted key (graceful stop) removes it, an expired key
    (the worker died) removes it and fails its in-flight streams with StreamDisconnected.
    A key that says ``"ready": false`` (its engine stalled or restarting) keeps the worker
    out of the set, its streams going on (the worker fails them over itself), until a
    key says it is ready again.
    A worker is also evicted as soon as NATS answers "no responders" for it (a request
    found nobody on its subject, or a ping nobody on its control subject, when its
    in-flight streams fail too), without waiting for its key to expire; it comes back
    when it refreshes its registration, which only a live worker does. After a
    reconnection the watch is renewed and the set re-synchronised; a worker whose key
    expired during the outage (it could not refresh it either) stays, with its streams,
    for ``timeouts.ttl + timeouts.settle`` seconds, and is lost only if it does not
    register again by then. ``codec``, ``timeouts``, ``window``
    and ``coalesce`` are the engines' (see :class:`RemoteEngine`). Use either::

        async with discovery.watch(worker_set):   # returns once the set is in sync
            ...
        await task_group.start(discovery.run, worker_set)
    """

    def __init__(
        self,
        nc: Client,
        *,
        model: str,
        role: str = "aggregated",
        bucket: str = DEFAULT_BUCKET,
        codec: Codec | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        timeouts: NatsTimeouts | None = None,
        window: int = DEFAULT_WINDOW,
        coalesce: Coalesce | None = None,
    ) -> None:
        self._nc = nc
        self.model = model
        self.role = wire.check_role(role)
        self._bucket = bucket
        self._codec = codec
        self._namespace = namespace
        self._timeouts = timeouts
        self._window = window
        self._coalesce = coalesce
        self._filter = f"{wire.escape_token(model)}.{role}.*"
        timing = timeouts if timeouts is not None else NatsTimeouts()
        #: how long after a reconnection a missing registration is given to come back
        self._grace = timing.ttl + timing.settle
        self._bus = bus_of(nc)

    @asynccontextmanager
    async def watch(self, worker_set: WorkerSet[In, Out]) -> AsyncGenerator[WorkerSet[In, Out]]:
        """Feed ``worker_set`` while the block runs; entering waits for the first sync.

        Raises:
            JetStreamUnavailable: when the bucket cannot be watched at first.
        """
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.run, worker_set)
                try:
                    yield worker_set
                finally:
                    tg.cancel_scope.cancel()
        except* JetStreamUnavailable as group:
            # It failed before it started: the one error, not a group of one.
            raise group.exceptions[0] from None

    async def run(
        self,
        worker_set: WorkerSet[In, Out],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Feed ``worker_set`` until cancelled; ``task_status`` is told after the first sync.

        Only the workers this call added are ever removed; when it ends they stay.

        Raises:
            JetStreamUnavailable: when the bucket cannot be watched at first (later
                failures, like a server restart, are retried).
        """
        registry: _Registry[In, Out] = _Registry(worker_set)
        try:
            await watch_bucket(
                self._nc,
                self._bucket,
                self._filter,
                functools.partial(self._on_entry, registry),
                on_watch=registry.watching,
                on_replayed=functools.partial(self._replayed, registry),
                task_status=task_status,
            )
        finally:
            if registry.timer is not None:
                registry.timer.cancel()

    def _replayed(self, registry: _Registry[In, Out]) -> None:
        """A watch's replay is complete: a worker it did not replay is gone, or (around an
        outage) unconfirmed."""
        if registry.present is None:
            return
        for gone in set(registry.known) - registry.present:
            self._doubt(registry, gone, lost="its registration is gone")
        registry.present = None

    def _on_entry(self, registry: _Registry[In, Out], entry: KeyValue.Entry) -> None:
        present = self._apply(registry, entry)
        if registry.present is not None and present is not None:
            registry.present.add(present)

    def _apply(self, registry: _Registry[In, Out], entry: KeyValue.Entry) -> str | None:
        """Apply one KV entry; the worker id when it is (still) registered."""
        worker_id = entry.key.rsplit(".", 1)[-1]
        if entry.operation == "DEL":
            registry.evicted.pop(worker_id, None)
            self._forget(registry, worker_id, lost=None)
            return None
        if entry.operation is not None:  # PURGE: an expired TTL, or purged by an operator
            registry.evicted.pop(worker_id, None)
            registry.unready.pop(worker_id, None)
            self._doubt(registry, worker_id, lost="its discovery key expired")
            return None
        revision = entry.revision or 0
        if registry.unconfirmed.pop(worker_id, None) is not None:
            logger.info("discovery of %s: worker %s registered again", self.model, worker_id)
        evicted = registry.evicted.get(worker_id)
        if evicted is not None:
            if revision <= evicted:
                return None  # the registration it had when it was evicted, replayed
            del registry.evicted[worker_id]
            logger.info("discovery of %s: evicted worker %s is back", self.model, worker_id)
        value = entry.value or b""
        previous = registry.known.get(worker_id)
        if previous is not None and previous[0] == value:
            # A TTL refresh: a new revision of the same value.
            registry.known[worker_id] = (value, revision, previous[2])
            return worker_id
        try:
            info = json.loads(value)
            if info["id"] != worker_id:
                raise ValueError(f"the key names worker {worker_id!r}")
            if info.get("ready", True) is False:
                self._unready(registry, worker_id, str(info.get("reason") or "not ready"))
                return None
            engine: RemoteEngine[In, Out] = RemoteEngine(
                self._nc,
                worker_id=worker_id,
                subject=str(info["subject"]),
                control_subject=str(info["control"]),
                codec=self._codec,
                namespace=self._namespace,
                timeouts=self._timeouts,
                window=self._window,
                coalesce=self._coalesce,
                on_no_responders=functools.partial(self._evict, registry, worker_id),
            )
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("discovery: ignoring malformed registration %r: %r", value, exc)
            return None
        registry.known[worker_id] = (value, revision, engine)
        registry.workers.add(worker_id, engine)
        unready = registry.unready.pop(worker_id, None)
        if unready is not None and unready[1]:
            logger.info("discovery of %s: worker %s is ready again", self.model, worker_id)
        else:
            logger.info("discovery of %s: worker %s joined", self.model, worker_id)
        return worker_id

    def _unready(self, registry: _Registry[In, Out], worker_id: str, why: str) -> None:
        """``worker_id`` says it is not ready: out of the set (new requests go to others),
        its in-flight streams untouched (it fails them over itself)."""
        served = registry.known.pop(worker_id, None) is not None
        if served:
            registry.workers.remove(worker_id)
        before = registry.unready.get(worker_id)
        served = served or (before is not None and before[1])
        if before is None or before[0] != why:
            # (a new worker not ready yet is no news; one that served and stopped is)
            logger.log(
                logging.WARNING if served else logging.INFO,
                "discovery of %s: worker %s is not ready: %s",
                self.model,
                worker_id,
                why,
            )
        registry.unready[worker_id] = (why, served)

    def _doubt(self, registry: _Registry[In, Out], worker_id: str, *, lost: str) -> None:
        """A registration went missing or expired: the worker is lost, unless this follows
        an outage of our connection (see the class docstring)."""
        if worker_id not in registry.known or worker_id in registry.unconfirmed:
            return
        if self._bus.settled(self._grace):
            self._forget(registry, worker_id, lost=lost)
        else:
            registry.unconfirmed[worker_id] = time.monotonic() + self._grace
            if registry.timer is None:
                self._expire_later(registry, self._grace)

    def _expire_later(self, registry: _Registry[In, Out], delay: float) -> None:
        loop = asyncio.get_running_loop()
        registry.timer = loop.call_later(delay, self._expire_unconfirmed, registry)

    def _expire_unconfirmed(self, registry: _Registry[In, Out]) -> None:
        """Forget the unconfirmed workers whose time to register again is up (a timer
        calls it when the first is due)."""
        registry.timer = None
        now = time.monotonic()
        for worker_id, deadline in list(registry.unconfirmed.items()):
            if deadline <= now:
                del registry.unconfirmed[worker_id]
                lost = "it did not register again after the NATS outage"
                self._forget(registry, worker_id, lost=lost)
        if registry.unconfirmed:
            self._expire_later(registry, min(registry.unconfirmed.values()) - now)

    def _evict(
        self,
        registry: _Registry[In, Out],
        worker_id: str,
        subject: Literal["request", "control"],
    ) -> None:
        """NATS found nobody on a subject of ``worker_id``: take it out of the set now.

        Called by the worker's engine before its stream raises, so the retry that follows
        sees the set without it. Nobody on the control subject means the whole worker is
        gone: its other in-flight streams fail too. Nobody on the request subject may be a
        worker draining before it leaves: its in-flight streams go on.
        """
        previous = registry.known.get(worker_id)
        if previous is None:
            return  # already evicted, or removed meanwhile
        registry.evicted[worker_id] = previous[1]
        lost = f"its {subject} subject has no responders"
        self._forget(registry, worker_id, lost=lost, abort=subject == "control")

    def _forget(
        self,
        registry: _Registry[In, Out],
        worker_id: str,
        *,
        lost: str | None,
        abort: bool = True,
    ) -> None:
        """Remove a worker this discovery added; when ``lost`` (and ``abort``), fail its
        in-flight streams."""
        registry.unconfirmed.pop(worker_id, None)
        registry.unready.pop(worker_id, None)
        previous = registry.known.pop(worker_id, None)
        if previous is None:
            return
        registry.workers.remove(worker_id)
        if lost is None:
            logger.info("discovery of %s: worker %s left", self.model, worker_id)
        else:
            logger.warning("discovery of %s: worker %s lost: %s", self.model, worker_id, lost)
            if abort:
                previous[2].abort(f"worker {worker_id} lost: {lost}")

    def __repr__(self) -> str:
        return f"NatsDiscovery(model={self.model!r}, role={self.role!r})"
