"""Following a KV bucket: :func:`watch_bucket`, over one watch per connection and bucket.

A ``serve --nats`` frontend follows the discovery bucket five times over (the model list,
and each model's four roles). Five watches made five JetStream consumers on the server and,
through nats-py's KV watch (an ordered consumer), five flow-control tasks waking 4 times a
second each, plus a poll of ours per watch: ~40 wake-ups a second of an idle frontend for a
bucket that changes when a worker comes or goes. So a connection has one
:class:`SharedWatch` per bucket, whose followers (:func:`~.bucket.watch_bucket` calls) each
get the entries under their own key filter:

* one consumer, made here rather than by ``KeyValue.watch``: push, last value per key,
  no acknowledgements, and no flow control (the bucket holds one small record per
  worker), so no task of nats-py polls for it; the server sends a heartbeat after
  :data:`IDLE_HEARTBEAT` seconds of silence, and a consumer not heard of for two of
  them (deleted, or gone with the server that held it) is renewed, as nats-py's
  ordered consumer would;
* it is renewed after each reconnection (a consumer does not survive a server restart),
  or when its delivery sequence shows a gap: each renewal replays the bucket to every
  follower, between its ``on_watch`` and ``on_replayed``;
* a follower that joins a running watch gets the bucket as it stands from what the
  watch holds (every key's last value; a deletion or expiry marker tells a newcomer
  nothing, so none is replayed to it); an entry on its way to the watch then comes
  after ``on_replayed``, as a change;
* one follower at a time, the *driver*, waits for what calls for a renewal: told of a
  reconnection by the connection's :class:`~.bus.Bus` when :func:`~.connect` made it
  (otherwise it looks every :data:`~.bus.RECONNECT_POLL` seconds), or of a gap by the
  watch; an idle frontend's watch wakes once per heartbeat check.

Entries are handed to the followers in nats-py's subscription task, as they arrive: the
followers' callbacks must be quick. One that raises ends its own follower (its
:func:`~.bucket.watch_bucket` raises it), not the others.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import nats.errors
from anyio.abc import TaskStatus
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue

from .bucket import JetStreamUnavailable, jetstream_unavailable, open_bucket
from .bus import RECONNECT_POLL, bus_of

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

__all__ = ("IDLE_HEARTBEAT", "SharedWatch", "shared_watch", "watch_bucket")

logger = logging.getLogger(__name__)

#: seconds of silence after which the server tells the watch it is still there
IDLE_HEARTBEAT: Final = 5.0
#: a consumer without followers' interest is deleted by the server after this (seconds)
_INACTIVE: Final = 60.0
#: what the server puts in a heartbeat: the last delivery sequence it sent
_LAST_CONSUMER: Final = "Nats-Last-Consumer"
#: the operation of a marker the server leaves, by its reason (nats-server 2.11+: an
#: expired TTL or a purge; a marker of another reason is not an entry)
_MARKERS: Final = {"MaxAge": KV_PURGE, "Purge": KV_PURGE, "Remove": KV_DEL}

_WATCHES: weakref.WeakKeyDictionary[Client, dict[str, SharedWatch]] = weakref.WeakKeyDictionary()


async def watch_bucket(
    nc: Client,
    bucket: str,
    keys: str,
    on_entry: Callable[[KeyValue.Entry], None],
    *,
    on_watch: Callable[[], None] | None = None,
    on_replayed: Callable[[], None] | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Follow the entries of ``bucket`` under ``keys`` (a KV key filter) until cancelled.

    A watch replays the bucket as it stands, then tells every change. It does not survive
    a server restart, so after each reconnection of ``nc`` the watch is renewed, and the
    bucket replayed again: ``on_watch()`` marks where each replay (the first and every
    renewal's) begins, ``on_replayed()`` where it ends, and ``on_entry(entry)`` is
    called for each entry in between and after (a value, or a DEL or PURGE marker).
    ``task_status`` is told after the first complete replay. The callbacks run on the
    event loop, in nats-py's subscription task: they must be quick. Every call on one
    connection shares one watch of the bucket (see the module docstring).

    Raises:
        JetStreamUnavailable: when the bucket cannot be watched at first (later
            failures, like a server restart, are retried).
        Exception: what one of the callbacks raised.
    """
    watch = shared_watch(nc, bucket)
    follower = _Follower(keys, on_entry, on_watch, on_replayed)
    try:
        await watch.join(follower)
        await follower.replayed.wait()
        if follower.error is not None:
            raise follower.error
        task_status.started()
        await watch.follow(follower)
    finally:
        with anyio.CancelScope(shield=True):
            await watch.leave(follower)


def shared_watch(nc: Client, bucket: str) -> SharedWatch:
    """The watch of ``bucket`` on ``nc`` (one per connection and bucket)."""
    watches = _WATCHES.setdefault(nc, {})
    watch = watches.get(bucket)
    if watch is None:
        watch = watches[bucket] = SharedWatch(nc, bucket)
    return watch


def _matches(pattern: list[str], key: list[str]) -> bool:
    """Whether ``key``'s tokens match a NATS key filter's (``*`` one token, ``>`` the rest)."""
    for index, token in enumerate(pattern):
        if token == ">":
            return len(key) > index
        if index >= len(key) or (token != "*" and token != key[index]):
            return False
    return len(key) == len(pattern)


@final
class _Follower:
    """One :func:`~.bucket.watch_bucket` call: its key filter and callbacks."""

    __slots__ = ("error", "on_entry", "on_replayed", "on_watch", "pattern", "replayed", "turn")

    def __init__(
        self,
        keys: str,
        on_entry: Callable[[KeyValue.Entry], None],
        on_watch: Callable[[], None] | None,
        on_replayed: Callable[[], None] | None,
    ) -> None:
        self.pattern = keys.split(".")
        self.on_entry = on_entry
        self.on_watch = on_watch
        self.on_replayed = on_replayed
        #: set once a first replay was told (or the follower failed)
        self.replayed = anyio.Event()
        #: set when it is this follower's turn to drive (or it failed)
        self.turn = anyio.Event()
        #: what one of its callbacks raised: it ends with it
        self.error: BaseException | None = None


@final
class SharedWatch:
    """The one watch of a bucket on a connection (see the module docstring)."""

    def __init__(self, nc: Client, bucket: str) -> None:
        self._nc = nc
        self._bucket = bucket
        self._prefix = f"$KV.{bucket}."
        self._bus = bus_of(nc)
        self._followers: list[_Follower] = []
        self._entries: dict[str, KeyValue.Entry] = {}  # every key's last value
        self._subscription: Subscription | None = None
        self._generation = 0  # which consumer the messages arriving belong to
        self._delivered = 0  # its last delivery sequence received
        self._heard = 0.0  # when it last sent anything (time.monotonic)
        self._replaying = False  # its replay is not complete yet
        self._reconnects = 0  # the reconnection count it was made under
        self._stale = False  # it must be renewed (a gap, or a renewal that failed)
        self._wake = anyio.Event()  # what the driver waits for
        self._lock = anyio.Lock()
        self._stop_listening: Callable[[], None] | None = None

    # -- followers

    async def join(self, follower: _Follower) -> None:
        """Add ``follower``; it is told the bucket as it stands (the first one opens the
        watch).

        Raises:
            JetStreamUnavailable: when the first watch cannot be opened.
        """
        async with self._lock:
            first = self._subscription is None and not self._followers
            self._followers.append(follower)
            if first:
                try:
                    await self._open()
                except BaseException:
                    self._followers.remove(follower)
                    raise
                if self._stop_listening is None:
                    self._stop_listening = self._bus.on_reconnection(self._wake.set)
                return
        # The watch is open (or being renewed): what it holds is the bucket as it stands.
        self._call(follower, follower.on_watch)
        for key, entry in list(self._entries.items()):
            if _matches(follower.pattern, key.split(".")):
                self._call(follower, follower.on_entry, entry)
        if not self._replaying:
            self._replayed(follower)

    async def follow(self, follower: _Follower) -> None:
        """Run until cancelled: drive the watch while it is ``follower``'s turn.

        Raises:
            BaseException: what one of ``follower``'s callbacks raised.
        """
        while True:
            if follower.error is not None:
                raise follower.error
            if self._followers and self._followers[0] is follower:
                await self._drive()
            else:
                await follower.turn.wait()
                follower.turn = anyio.Event()

    async def leave(self, follower: _Follower) -> None:
        """Remove ``follower``; the last one closes the watch."""
        if follower not in self._followers:
            return
        driving = self._followers[0] is follower
        self._followers.remove(follower)
        if self._followers:
            if driving:
                self._followers[0].turn.set()
            return
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None
        await self._close()
        watches = _WATCHES.get(self._nc)
        if watches is not None and watches.get(self._bucket) is self and not self._followers:
            del watches[self._bucket]

    # -- the consumer

    async def _drive(self) -> None:
        """Wait for what calls for a renewal (at most one heartbeat check), then renew."""
        bus = self._bus
        wake = self._wake
        period = 2 * IDLE_HEARTBEAT if bus.informed and not self._stale else RECONNECT_POLL
        with anyio.move_on_after(period):
            await wake.wait()
        if wake.is_set():
            self._wake = anyio.Event()
        if not bus.connected:
            return  # renewed once it is back
        silent = time.monotonic() - self._heard > 2 * IDLE_HEARTBEAT
        if self._stale or silent or self._nc.stats["reconnects"] != self._reconnects:
            async with self._lock:
                await self._renew()

    async def _renew(self) -> None:
        logger.info("watch of the bucket %s: renewing it", self._bucket)
        try:
            await self._open()
        except JetStreamUnavailable as exc:
            self._stale = True  # tried again at the next poll
            if self._bus.connected:
                logger.warning("cannot watch the bucket %s yet: %s", self._bucket, exc)

    async def _open(self) -> None:
        """(Re)make the consumer; every follower is told the replay from its start.

        Raises:
            JetStreamUnavailable: when the bucket cannot be opened or watched.
        """
        await self._close()
        nc = self._nc
        self._generation += 1
        generation = self._generation
        self._entries.clear()
        self._delivered = 0
        self._replaying = True
        self._stale = True  # until the consumer is made (a cancelled renewal is redone)
        self._reconnects = nc.stats["reconnects"]
        self._heard = time.monotonic()
        try:
            await open_bucket(nc.jetstream(), self._bucket, nc=nc)  # made when missing
            inbox = nc.new_inbox()

            async def on_msg(msg: Msg) -> None:
                if generation == self._generation:
                    self._on_msg(msg)

            self._subscription = await nc.subscribe(inbox, cb=on_msg)
            config = ConsumerConfig(
                deliver_subject=inbox,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                ack_policy=AckPolicy.NONE,
                max_deliver=1,
                filter_subject=f"{self._prefix}>",
                idle_heartbeat=IDLE_HEARTBEAT,
                flow_control=False,
                mem_storage=True,
                num_replicas=1,
                inactive_threshold=_INACTIVE,
            )
            for follower in list(self._followers):  # (its replay starts with the consumer)
                self._call(follower, follower.on_watch)
            info = await nc.jsm().add_consumer(f"KV_{self._bucket}", config)
        except Exception as exc:  # nats and JetStream API errors
            raise jetstream_unavailable("watch", self._bucket, exc, nc) from exc
        self._stale = False
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if not info.num_pending and self._delivered >= (delivered or 0):
            self._replay_done()  # nothing to replay (or it all arrived already)

    async def _close(self) -> None:
        subscription, self._subscription = self._subscription, None
        self._generation += 1  # whatever it still delivers is ignored
        if subscription is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                try:
                    await subscription.unsubscribe()
                except nats.errors.Error as exc:  # the connection is closed
                    logger.debug("stopping the watch of %s: %r", self._bucket, exc)

    def _on_msg(self, msg: Msg) -> None:
        """A message of the current consumer: a heartbeat, or an entry for the followers."""
        self._heard = time.monotonic()
        headers = msg.headers
        if not msg.reply:  # a status message: the idle heartbeat
            last = (headers or {}).get(_LAST_CONSUMER)
            if last is not None and last.isdigit() and int(last) != self._delivered:
                self._lost(f"the heartbeat says #{last}, #{self._delivered} arrived")
            return
        meta = msg.metadata
        if meta.sequence.consumer != self._delivered + 1:
            self._lost(f"#{meta.sequence.consumer} after #{self._delivered}")
            return
        self._delivered = meta.sequence.consumer
        operation = headers.get(KV_OP) if headers is not None else None
        reason = headers.get(KV_MARKER_REASON) if headers is not None and not operation else None
        if reason is not None:
            operation = _MARKERS.get(reason)
        key = msg.subject[len(self._prefix) :]
        if reason is None or operation is not None:
            entry = KeyValue.Entry(
                bucket=self._bucket,
                key=key,
                value=msg.data,
                revision=meta.sequence.stream,
                delta=meta.num_pending,
                created=meta.timestamp,  # type: ignore[arg-type]  # (as KeyValue.watch does)
                operation=operation,
            )
            if operation is None:
                self._entries[key] = entry
            else:
                self._entries.pop(key, None)
            tokens = key.split(".")
            for follower in list(self._followers):
                if _matches(follower.pattern, tokens):
                    self._call(follower, follower.on_entry, entry)
        if self._replaying and meta.num_pending == 0:
            self._replay_done()

    def _lost(self, what: str) -> None:
        """Entries were lost (a gap in the delivery sequence): renew, and replay."""
        if not self._stale:
            logger.info("watch of the bucket %s lost entries (%s): renewing it", self._bucket, what)
        self._stale = True
        self._wake.set()

    def _replay_done(self) -> None:
        if self._replaying:
            self._replaying = False
            for follower in list(self._followers):
                self._replayed(follower)

    def _replayed(self, follower: _Follower) -> None:
        self._call(follower, follower.on_replayed)
        follower.replayed.set()

    def _call(self, follower: _Follower, callback: Callable[..., None] | None, *args: Any) -> None:
        """Call one of ``follower``'s callbacks; what it raises ends that follower."""
        if callback is None or follower.error is not None:
            return
        try:
            callback(*args)
        except Exception as exc:
            follower.error = exc
            follower.replayed.set()
            follower.turn.set()
            self._wake.set()

    def __repr__(self) -> str:
        return f"SharedWatch({self._bucket!r}, followers={len(self._followers)})"
