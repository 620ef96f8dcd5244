"""Where stored responses live: the :class:`ResponseStore` protocol and the in-memory store.

A stored response is one record (:class:`StoredResponse`): the response object as the
client got it, every input item that produced it (earlier turns' inputs and outputs
included, in order: a continuation reads one record, never a chain), and the owner it is
scoped to (a digest of the API key that created it; another key finds nothing). The store
itself keeps opaque bytes by response id, so a store of your own is three coroutines::

    class RedisStore:                                   # any key-value store with a TTL
        async def get(self, key: str) -> bytes | None: return await redis.get(key)
        async def put(self, key: str, value: bytes) -> None: await redis.set(key, value, ex=TTL)
        async def delete(self, key: str) -> bool: return bool(await redis.delete(key))

    app = build_app(engine, tokenizer, model_name="m", responses_store=RedisStore())

:class:`MemoryResponseStore` is the default: bounded by bytes (least recently used
records leave first) and by age (a TTL from when a record was stored). Under ``serve
--nats`` the records live in NATS JetStream instead (:mod:`.nats_store`), so every frontend
sees them and they outlive a frontend's restart.

Why whole records and not a chain of parents: a continuation costs one lookup at any
depth, an evicted or expired ancestor cannot break a conversation half-way, and a record is
about the size of the prompt it produced (what the request carried anyway).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol, final

import orjson

__all__ = (
    "DEFAULT_STORE_MB",
    "DEFAULT_STORE_TTL",
    "MemoryResponseStore",
    "ResponseStore",
    "StoreFull",
    "StoredResponse",
)

#: the in-memory store's default size (``--responses-store-mb``)
DEFAULT_STORE_MB: Final = 256
#: how long a stored response is kept by default, in seconds (``--responses-store-ttl``)
DEFAULT_STORE_TTL: Final = 24 * 3600.0


class StoreFull(Exception):
    """A record larger than the whole store: it cannot be kept."""


class ResponseStore(Protocol):
    """Where stored responses live: bytes by response id. Every method may raise on a
    backend failure; the edge turns that into a 500 (never a silent loss)."""

    async def get(self, key: str, /) -> bytes | None:
        """The record stored as ``key``, or None (never stored, deleted, expired)."""
        ...

    async def put(self, key: str, value: bytes, /) -> None:
        """Store ``value`` as ``key`` (replacing what was there)."""
        ...

    async def delete(self, key: str, /) -> bool:
        """Remove ``key``; whether it was there."""
        ...


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: what ``GET``, ``input_items`` and a continuation read."""

    #: the response object as the client got it
    response: dict[str, Any]
    #: every input item that produced it, earlier turns included, oldest first
    input_items: list[dict[str, Any]]
    #: who may read it (:meth:`operators.edges.http.guard.Guard.owner`)
    owner: str

    def encode(self) -> bytes:
        """The record as the store keeps it."""
        return orjson.dumps(
            {"owner": self.owner, "response": self.response, "input_items": self.input_items}
        )

    @classmethod
    def decode(cls, data: bytes) -> StoredResponse:
        """A record the store gave back.

        Raises:
            ValueError: the bytes are no record of this edge's.
        """
        record = orjson.loads(data)
        if not isinstance(record, dict) or not isinstance(record.get("response"), dict):
            raise ValueError("not a stored response")
        return cls(record["response"], list(record.get("input_items") or ()), record["owner"])

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The items a continuation starts from: the inputs, then this response's output."""
        return [*self.input_items, *self.response.get("output", ())]


@final
class MemoryResponseStore:
    """Responses kept in this process: at most ``max_bytes`` (the least recently used
    records leave first), each for ``ttl`` seconds after it was stored.

    Raises:
        ValueError: a bound that is not positive.
    """

    __slots__ = ("_clock", "_records", "max_bytes", "size", "ttl")

    def __init__(
        self,
        max_bytes: int = DEFAULT_STORE_MB * 1024 * 1024,
        ttl: float = DEFAULT_STORE_TTL,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0 or not ttl > 0:
            raise ValueError(f"the store needs max_bytes > 0 and ttl > 0, got {max_bytes}, {ttl}")
        self.max_bytes = max_bytes
        self.ttl = ttl
        #: bytes held now
        self.size = 0
        self._clock = clock
        #: key -> (expiry, value), least recently used first
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, key: str, /) -> bytes | None:
        """The record, unless it expired (then it is dropped)."""
        found = self._records.get(key)
        if found is None:
            return None
        expiry, value = found
        if self._clock() >= expiry:
            self._drop(key)
            return None
        self._records.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, /) -> None:
        """Store ``value``; older records leave until it fits.

        Raises:
            StoreFull: ``value`` alone is larger than the store.
        """
        if len(value) > self.max_bytes:
            raise StoreFull(
                f"a stored response of {len(value)} bytes does not fit the store "
                f"({self.max_bytes} bytes)"
            )
        if key in self._records:
            self._drop(key)
        records = self._records
        now = self._clock()
        while records:  # expired records first, from the least recently used end
            oldest = next(iter(records))
            if records[oldest][0] > now and self.size + len(value) <= self.max_bytes:
                break
            self._drop(oldest)
        records[key] = (now + self.ttl, value)
        self.size += len(value)

    async def delete(self, key: str, /) -> bool:
        """Remove ``key``; whether it was there (and not expired)."""
        found = self._records.get(key)
        if found is None:
            return False
        self._drop(key)
        expiry: float = found[0]
        return self._clock() < expiry

    def _drop(self, key: str) -> None:
        _, value = self._records.pop(key)
        self.size -= len(value)

    def __repr__(self) -> str:
        return (
            f"MemoryResponseStore({len(self._records)} records, {self.size}/{self.max_bytes} "
            f"bytes, ttl={self.ttl:g}s)"
        )
