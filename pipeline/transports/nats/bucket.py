"""The discovery bucket: opened (created when missing) and followed.

Workers register in a JetStream KV bucket (:mod:`.registration`); discovery
(:class:`~.discovery.NatsDiscovery`, one model's workers) and :class:`~.models.NatsModels`
(every model's names) follow it with :func:`watch_bucket`, which keeps one watch going
through server restarts: a KV watch does not survive one, so the watch is renewed after
every reconnection, and each renewal replays the bucket as it stands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import nats.errors
import nats.js.errors
from anyio.abc import TaskStatus
from nats.js.api import KeyValueConfig

from .bus import bus_of

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = (
    "DEFAULT_BUCKET",
    "MARKER_TTL",
    "RECONNECT_POLL",
    "JetStreamUnavailable",
    "jetstream_unavailable",
    "open_bucket",
    "watch_bucket",
)

logger = logging.getLogger(__name__)

#: the JetStream KV bucket workers register in
DEFAULT_BUCKET: Final = "llm-pipeline-workers"
#: how long the server keeps the marker of an expired key (what tells watchers of a death)
MARKER_TTL: Final = 60.0
#: how often a watch looks for a reconnection (after which it must be renewed)
RECONNECT_POLL: Final = 0.25


class JetStreamUnavailable(RuntimeError):
    """Discovery's JetStream KV bucket cannot be used: the server has no JetStream, or this
    connection may not create, read or write the bucket. A mistake in the deployment, said
    once at start (the message names the bucket and what the server answered)."""


def jetstream_unavailable(
    what: str, bucket: str, exc: BaseException, nc: Client | None = None
) -> JetStreamUnavailable:
    """The error for ``exc`` while doing ``what`` with ``bucket``, with the server's last
    complaint on ``nc`` (a permissions violation is reported apart from the request it
    made fail, which only times out)."""
    if isinstance(exc, JetStreamUnavailable):
        return exc
    reason = str(exc) or type(exc).__name__
    told = bus_of(nc).last_error if nc is not None else None
    if told is not None:
        reason += f"; the server said: {told}"
    return JetStreamUnavailable(
        f"cannot {what} the JetStream KV bucket {bucket!r} (workers register there): {reason}"
    )


async def open_bucket(
    js: JetStreamContext, bucket: str = DEFAULT_BUCKET, *, nc: Client | None = None
) -> KeyValue:
    """The workers' KV bucket, created when missing (per-key TTLs and expiry markers on).

    Raises:
        JetStreamUnavailable: when the server has no JetStream, or the bucket cannot be
            opened or created (permissions; JetStream's own timeout bounds the wait).
    """
    try:
        try:
            return await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            pass
        config = KeyValueConfig(bucket=bucket, history=1, limit_marker_ttl=MARKER_TTL)
        try:
            return await js.create_key_value(config)
        except nats.js.errors.APIError:
            return await js.key_value(bucket)  # another process created it first
    except nats.js.errors.ServiceUnavailableError as exc:
        raise JetStreamUnavailable(
            "the NATS server has no JetStream, which discovery needs: start nats-server "
            "with -js (from Python, NatsWorker(register=False) serves without discovery)"
        ) from exc
    except (nats.errors.Error, OSError) as exc:
        raise jetstream_unavailable("open", bucket, exc, nc) from exc


async def watch_bucket(
    nc: Client,
    bucket: str,
    keys: str,
    on_entry: Callable[[KeyValue.Entry], None],
    *,
    on_watch: Callable[[], None] | None = None,
    on_replayed: Callable[[], None] | None = None,
    on_poll: Callable[[], None] | None = None,
    name: str,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Follow the entries of ``bucket`` under ``keys`` (a KV key filter) until cancelled.

    A watch replays the bucket as it stands, then tells every change. It does not survive
    a server restart, so after each reconnection of ``nc`` the watch is renewed, and the
    bucket replayed again: ``on_watch()`` marks where each watch (the first and every
    renewal) begins, ``on_replayed()`` where its replay ends, and ``on_entry(entry)`` is
    called for each entry in between and after (a value, or a DEL or PURGE marker).
    ``on_poll()`` is called after each entry and whenever ``RECONNECT_POLL`` seconds
    passed without one. ``task_status`` is told after the first complete replay. The
    callbacks run on the event loop, inside the watch: they must be quick. ``name``
    prefixes the log lines ("discovery of smollm2: ...").

    Raises:
        JetStreamUnavailable: when the bucket cannot be watched at first (later
            failures, like a server restart, are retried).
    """
    bus = bus_of(nc)
    watched = False  # a watch was opened once: failures from now on are retried
    replayed = False  # task_status was told
    while True:
        reconnects = nc.stats["reconnects"]
        try:
            kv = await open_bucket(nc.jetstream(), bucket, nc=nc)
            watcher = await kv.watch(keys)
        except Exception as exc:  # nats and JetStream API errors
            if not watched:
                raise jetstream_unavailable("watch", bucket, exc, nc) from exc
            if bus.connected:
                logger.warning("%s: cannot watch the bucket yet: %r", name, exc)
            await anyio.sleep(RECONNECT_POLL)
            continue
        watched = True
        try:
            if on_watch is not None:
                on_watch()
            while True:
                entry: Any = _NOTHING
                with anyio.move_on_after(RECONNECT_POLL):
                    try:
                        entry = await anext(watcher)
                    except StopAsyncIteration:  # stopped under us: renew it
                        break
                if nc.stats["reconnects"] != reconnects:
                    # An existing watch does not survive a server restart: renew it.
                    logger.info("%s: reconnected, renewing the watch", name)
                    break
                if on_poll is not None:
                    on_poll()
                if entry is _NOTHING:
                    continue
                if entry is None:  # the initial replay is complete
                    if on_replayed is not None:
                        on_replayed()
                    if not replayed:
                        replayed = True
                        task_status.started()
                    continue
                on_entry(entry)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                try:
                    await watcher.stop()  # type: ignore[no-untyped-call]
                except Exception as exc:
                    logger.debug("%s: stopping a stale watch: %r", name, exc)


_NOTHING: Final = object()
