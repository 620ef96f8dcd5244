"""Stored responses in NATS JetStream: :class:`NatsResponseStore`, shared by every frontend.

Under ``serve --nats`` the Responses edge keeps its records in a JetStream key-value
bucket (:data:`DEFAULT_BUCKET`), so a conversation started on one frontend continues on
any other, and outlives the frontend that started it (the bucket is on the NATS server's
disk). The bucket is bounded like the in-memory store, by age and by bytes: every record
expires ``ttl`` seconds after it was stored (the stream's ``max_age``), and when the bucket
is full the oldest records leave first (``discard: old``; first in, first out, where the
memory store evicts the least recently used).

A record larger than one NATS message (the server's ``max_payload``, 1 MB by default) is
split: its parts under ``<id>.<n>``, then the head under ``<id>``, so a reader that finds a
head finds its parts (unless they expired or were discarded with it: then the record is
gone, as if it had expired).

Needs the ``nats`` extra; loaded only by ``serve --nats``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final, final

import nats.js.errors
from nats.js import api

from .store import DEFAULT_STORE_MB, DEFAULT_STORE_TTL

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.kv import KeyValue

__all__ = ("DEFAULT_BUCKET", "NatsResponseStore")

logger = logging.getLogger(__name__)

#: the bucket every frontend of a NATS cluster keeps stored responses in
DEFAULT_BUCKET: Final = "llm_pipeline_responses"
#: what a head says: the record follows whole, or in parts
_WHOLE: Final = b"\x00"
_PARTS: Final = b"\x01"
#: room left in a message for NATS's own headers
_HEADROOM: Final = 4096


@final
class NatsResponseStore:
    """A :class:`~.store.ResponseStore` in the JetStream bucket ``kv``; make one with
    :meth:`open`."""

    __slots__ = ("_kv", "_part_bytes", "bucket", "max_record_bytes")

    def __init__(
        self, kv: KeyValue, *, bucket: str, part_bytes: int, max_record_bytes: int | None = None
    ) -> None:
        self._kv = kv
        self._part_bytes = part_bytes
        #: the JetStream KV bucket
        self.bucket = bucket
        #: the largest record the bucket can hold (its ``max_bytes``; None: unknown)
        self.max_record_bytes = max_record_bytes

    @classmethod
    async def open(
        cls,
        nc: Client,
        *,
        bucket: str = DEFAULT_BUCKET,
        ttl: float = DEFAULT_STORE_TTL,
        max_bytes: int = DEFAULT_STORE_MB * 1024 * 1024,
    ) -> NatsResponseStore:
        """The store in ``bucket``, created (or reconfigured: the last frontend to start
        sets the bounds) with ``ttl`` and ``max_bytes``.

        Raises:
            nats.errors.Error: JetStream cannot be reached or refuses the bucket.
        """
        js = nc.jetstream()
        config = api.StreamConfig(
            name=f"KV_{bucket}",
            subjects=[f"$KV.{bucket}.>"],
            allow_direct=True,
            allow_rollup_hdrs=True,
            deny_delete=True,
            discard=api.DiscardPolicy.OLD,
            duplicate_window=min(120.0, ttl),
            max_age=ttl,
            max_bytes=max_bytes,
            max_msgs_per_subject=1,
            storage=api.StorageType.FILE,
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:  # there, with other bounds: take ours
            await js.update_stream(config)
        kv = await js.key_value(bucket)
        return cls(
            kv,
            bucket=bucket,
            part_bytes=max(nc.max_payload - _HEADROOM, 1024),
            max_record_bytes=max_bytes,
        )

    async def get(self, key: str, /) -> bytes | None:
        """The record, or None (never stored, deleted, expired, discarded, a key that
        cannot name one)."""
        head = await self._value(key)
        if head is None or not head:
            return None
        if head[:1] == _WHOLE:
            return head[1:]
        count = int(head[1:])
        parts = []
        for number in range(count):
            part = await self._value(f"{key}.{number}")
            if part is None:
                return None
            parts.append(part)
        return b"".join(parts)

    async def put(self, key: str, value: bytes, /) -> None:
        """Store ``value`` (in parts when larger than a message)."""
        size = self._part_bytes
        if len(value) < size:
            await self._kv.put(key, _WHOLE + value)
            return
        parts = [value[start : start + size] for start in range(0, len(value), size)]
        for number, part in enumerate(parts):
            await self._kv.put(f"{key}.{number}", part)
        await self._kv.put(key, _PARTS + str(len(parts)).encode())

    async def delete(self, key: str, /) -> bool:
        """Remove the record (and its parts); whether it was there."""
        head = await self._value(key)
        if head is None:
            return False
        await self._kv.delete(key)
        if head[:1] == _PARTS:
            for number in range(int(head[1:])):
                await self._kv.delete(f"{key}.{number}")
        return True

    async def _value(self, key: str) -> bytes | None:
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.InvalidKeyError):
            return None
        return entry.value

    def __repr__(self) -> str:
        return f"NatsResponseStore({self.bucket!r})"
