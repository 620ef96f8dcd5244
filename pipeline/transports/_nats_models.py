"""Which models workers register for: :class:`NatsModels` (see :mod:`.nats`).

A frontend that serves whatever its workers serve (``serve --nats`` without a model name)
watches every key of the discovery bucket, ``<model>.<role>.<worker id>``, and hears of
each model name the first time a worker registers for it; following each model's workers
is then :class:`~._nats_discovery.NatsDiscovery`'s job, one per model and role.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

import anyio
from anyio.abc import TaskStatus

from . import _wire
from ._nats_bus import bus_of
from ._wire import DEFAULT_BUCKET, open_bucket

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ("NatsModels",)

logger = logging.getLogger(__name__)

#: how often the watch looks for a reconnection (after which it must be renewed)
_RECONNECT_POLL = 0.25


@final
class NatsModels:
    """Tells ``on_model(name)`` of every model some worker registered (or registers) for,
    once per name, in the order they appear::

        await task_group.start(NatsModels(nc).run, on_model)

    ``on_model`` runs on the event loop, inside the watch: it must be quick (start a task
    for anything longer). Models are never "unannounced": whether a model has workers
    now is what its own discovery follows.
    """

    def __init__(self, nc: Client, *, bucket: str = DEFAULT_BUCKET) -> None:
        self._nc = nc
        self._bucket = bucket
        self._bus = bus_of(nc)
        #: every model name heard of so far
        self.seen: set[str] = set()

    async def run(
        self,
        on_model: Callable[[str], None],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Watch until cancelled; ``task_status`` is told once the models registered now
        were announced.

        Raises:
            JetStreamUnavailable: when the bucket cannot be watched at first (later
                failures, like a server restart, are retried).
        """
        started = False
        while True:
            reconnects = self._nc.stats["reconnects"]
            try:
                kv = await open_bucket(self._nc.jetstream(), self._bucket, nc=self._nc)
                watcher = await kv.watch(">")
            except Exception as exc:  # nats and JetStream API errors
                if not started:
                    raise _wire.jetstream_unavailable("watch", self._bucket, exc, self._nc) from exc
                if self._bus.connected:
                    logger.warning("model discovery: cannot watch the bucket yet: %r", exc)
                await anyio.sleep(_RECONNECT_POLL)
                continue
            try:
                await self._follow(watcher, reconnects, on_model, None if started else task_status)
                started = True
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    try:
                        await watcher.stop()  # type: ignore[no-untyped-call]
                    except Exception as exc:
                        logger.debug("model discovery: stopping a stale watch: %r", exc)

    async def _follow(
        self,
        watcher: Any,
        reconnects: int,
        on_model: Callable[[str], None],
        task_status: TaskStatus[None] | None,
    ) -> None:
        """Announce the models of the watch's entries until the connection was renewed."""
        while True:
            entry: Any = _NOTHING
            with anyio.move_on_after(_RECONNECT_POLL):
                try:
                    entry = await anext(watcher)
                except StopAsyncIteration:  # stopped under us: renew it
                    return
            if self._nc.stats["reconnects"] != reconnects:
                return  # an existing watch does not survive a server restart: renew it
            if entry is _NOTHING:
                continue
            if entry is None:  # the initial replay is complete
                if task_status is not None:
                    task_status.started()
                    task_status = None
                continue
            if entry.operation is not None or not entry.value:
                continue  # a worker left: its model's discovery follows that
            name = _wire.unescape_token(entry.key.split(".", 1)[0])
            if name not in self.seen:
                self.seen.add(name)
                logger.info("model discovery: workers serve model %r", name)
                on_model(name)

    def __repr__(self) -> str:
        return f"NatsModels(seen={sorted(self.seen)})"


_NOTHING = object()
