"""A frontend's view of the planner: :class:`PlannerWatch` keeps its last status document.

The planner publishes its status after every round (:mod:`.wire`); a ``serve --nats``
frontend keeps the last one for its status page, which shows the planner's targets, its
pools' workers and their last changes. A document older than three of the planner's
intervals (and 10 s) is no longer shown: that planner stopped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import orjson
from anyio.abc import TaskStatus

from .wire import status_subject

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ("PlannerWatch",)

logger = logging.getLogger(__name__)

#: seconds past three intervals after which a planner's status counts as gone
_SLACK: Final = 10.0


@final
class PlannerWatch:
    """Follows the planner's status on ``nc``: ``await task_group.start(watch.run)``, then
    :meth:`last`."""

    def __init__(self, nc: Client, *, namespace: str) -> None:
        self._nc = nc
        self._subject = status_subject(namespace)
        self._last: dict[str, Any] | None = None
        self._heard = 0.0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow until cancelled; ``task_status`` is told once subscribed."""
        subscription = await self._nc.subscribe(self._subject, cb=self._on_status)
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await subscription.unsubscribe()

    def last(self) -> dict[str, Any] | None:
        """The planner's last status, with ``age_s`` (seconds since it came); None when no
        planner spoke lately."""
        found = self._last
        if found is None:
            return None
        age = time.monotonic() - self._heard
        interval = found.get("interval_s")
        if not isinstance(interval, int | float) or age > 3 * interval + _SLACK:
            return None
        return {**found, "age_s": round(age, 1)}

    async def _on_status(self, msg: Msg) -> None:
        try:
            found = orjson.loads(msg.data)
            if not isinstance(found, dict):
                raise TypeError(type(found).__name__)
        except (orjson.JSONDecodeError, TypeError) as exc:
            logger.warning("ignoring a malformed planner status: %r", exc)
            return
        self._last = found
        self._heard = time.monotonic()
