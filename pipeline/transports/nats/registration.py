"""A worker's entry in the discovery bucket: announced, kept alive, withdrawn.

Apart from :class:`~.worker.NatsWorker` because it is the whole of what a worker
tells :class:`~.discovery.NatsDiscovery`: one JSON record per worker under
``<model>.<role>.<worker id>``, published with a per-message TTL and refreshed three times
per TTL, so that a worker that dies without withdrawing disappears when its TTL runs out.
The record says whether the worker is ready (``"ready": false`` and why, while its engine
is stalled or restarting: :mod:`pipeline.health`); routers leave out one that is not.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, final

import anyio

from .bus import bus_of

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ("Registration",)

logger = logging.getLogger("pipeline.transports.nats.worker")


@final
class Registration:
    """The record ``record`` under ``key`` in ``bucket``, with a TTL of ``ttl`` seconds."""

    __slots__ = ("_bucket", "_key", "_record", "_ttl", "_value", "_worker_id")

    def __init__(self, bucket: str, key: str, record: dict[str, str], *, ttl: float) -> None:
        self._bucket = bucket
        self._key = key
        self._ttl = ttl
        self._record: dict[str, object] = dict(record)
        self._value = json.dumps(record).encode()
        self._worker_id = record["id"]

    def set_ready(self, ready: bool, reason: str | None = None) -> bool:
        """Say (from the next announcement on) whether the worker is ready, and why not;
        True when that changed the record."""
        record = {k: v for k, v in self._record.items() if k not in ("ready", "reason")}
        if not ready:
            record["ready"] = False
            if reason:
                record["reason"] = reason
        if record == self._record:
            return False
        self._record = record
        self._value = json.dumps(record).encode()
        return True

    async def announce(self, js: JetStreamContext) -> None:
        """Publish the record (again), with its TTL."""
        # KeyValue.put() takes no TTL: publish the revision ourselves, with a message TTL.
        await js.publish(
            f"$KV.{self._bucket}.{self._key}",
            self._value,
            headers={"Nats-TTL": f"{math.ceil(self._ttl)}s"},
        )

    async def refresh(self, js: JetStreamContext, nc: Client, scope: anyio.CancelScope) -> None:
        """Announce every third of the TTL until ``scope`` is cancelled.

        Not while the connection is down (the outage is logged once, by the connection),
        and a run of failures is one warning.
        """
        bus = bus_of(nc)
        failing = False
        with scope:
            while True:
                await anyio.sleep(self._ttl / 3)
                if not bus.connected:
                    continue
                try:
                    await self.announce(js)
                except Exception as exc:  # nats or JetStream API errors: retry next round
                    if not failing:
                        logger.warning(
                            "worker %s could not refresh its registration: %r",
                            self._worker_id,
                            exc,
                        )
                    failing = True
                else:
                    failing = False

    async def withdraw(self, kv: KeyValue) -> None:
        """Delete the record (giving up after a second: the TTL will expire it anyway)."""
        with anyio.move_on_after(1.0):
            try:
                await kv.delete(self._key)
            except Exception as exc:  # nats or JetStream API errors: the TTL will expire
                logger.warning("worker %s could not deregister: %r", self._worker_id, exc)
