"""Which models workers register for: :class:`NatsModels`.

A frontend that serves whatever its workers serve (``serve --nats`` without a model name)
watches every key of the discovery bucket, ``<model>.<role>.<worker id>``, and hears of
each model name the first time a worker registers for it; following each model's workers
is then :class:`~.discovery.NatsDiscovery`'s job, one per model and role.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, final

import anyio
from anyio.abc import TaskStatus

from . import wire
from .bucket import DEFAULT_BUCKET
from .watch import watch_bucket

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.kv import KeyValue

__all__ = ("NatsModels",)

logger = logging.getLogger(__name__)


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
        await watch_bucket(
            self._nc,
            self._bucket,
            ">",
            functools.partial(self._on_entry, on_model),
            task_status=task_status,
        )

    def _on_entry(self, on_model: Callable[[str], None], entry: KeyValue.Entry) -> None:
        """Announce the model of a registration, the first time it is seen."""
        if entry.operation is not None or not entry.value:
            return  # a worker left: its model's discovery follows that
        name = wire.unescape_token(entry.key.split(".", 1)[0])
        if name not in self.seen:
            self.seen.add(name)
            logger.info("model discovery: workers serve model %r", name)
            on_model(name)

    def __repr__(self) -> str:
        return f"NatsModels(seen={sorted(self.seen)})"
