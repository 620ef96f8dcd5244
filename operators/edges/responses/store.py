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

:class:`MemoryResponseStore` is the default: bounded by bytes and by age (a TTL from when a
record was stored). Each owner (API key) has a fair share of the bytes: when the store is
full, an owner over its share loses its own least recently used records first, and
otherwise the owner holding the most does, so one key cannot push the others' records
out (a store that shares by owner says so, ``by_owner = True``, and its ``put`` takes the
``owner``). A store may say the largest record it can hold (``max_record_bytes``): the edge
refuses to generate a response it could not store (a 400 naming ``input``). Under ``serve
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
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Protocol, final

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
    #: the bytes it was decoded from (0: made here)
    size: int = field(default=0, compare=False)

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
        items = list(record.get("input_items") or ())
        return cls(record["response"], items, record["owner"], len(data))

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The items a continuation starts from: the inputs, then this response's output."""
        return [*self.input_items, *self.response.get("output", ())]


@final
class MemoryResponseStore:
    """Responses kept in this process: at most ``max_bytes``, each for ``ttl`` seconds after
    it was stored; when full, the records of an owner over its fair share (``max_bytes``
    over the owners holding records) leave first, its least recently used first.

    Raises:
        ValueError: a bound that is not positive.
    """

    __slots__ = ("_clock", "_owners", "_records", "_used", "max_bytes", "size", "ttl")

    #: its ``put`` takes the owner of a record (and shares the bytes fairly among them)
    by_owner: ClassVar[bool] = True

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
        #: key -> (expiry, value, owner), least recently used first
        self._records: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()
        #: owner -> its keys, least recently used first
        self._owners: dict[str, OrderedDict[str, None]] = {}
        #: owner -> the bytes its records hold
        self._used: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    @property
    def max_record_bytes(self) -> int:
        """The largest record the store can hold."""
        return self.max_bytes

    def used_by(self, owner: str) -> int:
        """The bytes ``owner``'s records hold."""
        return self._used.get(owner, 0)

    async def get(self, key: str, /) -> bytes | None:
        """The record, unless it expired (then it is dropped)."""
        found = self._records.get(key)
        if found is None:
            return None
        expiry, value, owner = found
        if self._clock() >= expiry:
            self._drop(key)
            return None
        self._records.move_to_end(key)
        self._owners[owner].move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, /, *, owner: str = "") -> None:
        """Store ``value`` for ``owner``; records leave until it fits (see the class).

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
            if records[oldest][0] > now:
                break
            self._drop(oldest)
        while self.size + len(value) > self.max_bytes:
            self._drop(self._victim(owner, len(value)))
        records[key] = (now + self.ttl, value, owner)
        self._owners.setdefault(owner, OrderedDict())[key] = None
        self._used[owner] = self._used.get(owner, 0) + len(value)
        self.size += len(value)

    def _victim(self, owner: str, adding: int) -> str:
        """The record to drop so that ``owner`` may add ``adding`` bytes: its own least
        recently used when it is over its share, else that of the owner holding most."""
        used = self._used
        owners = len(used) + (owner not in used)
        share = self.max_bytes // owners
        mine = self._owners.get(owner)
        if mine and used[owner] + adding > share:
            return next(iter(mine))
        richest = max(used, key=used.__getitem__)
        return next(iter(self._owners[richest]))

    async def delete(self, key: str, /) -> bool:
        """Remove ``key``; whether it was there (and not expired)."""
        found = self._records.get(key)
        if found is None:
            return False
        self._drop(key)
        expiry: float = found[0]
        return self._clock() < expiry

    def _drop(self, key: str) -> None:
        _, value, owner = self._records.pop(key)
        self.size -= len(value)
        keys = self._owners[owner]
        del keys[key]
        if keys:
            self._used[owner] -= len(value)
        else:
            del self._owners[owner], self._used[owner]

    def __repr__(self) -> str:
        return (
            f"MemoryResponseStore({len(self._records)} records, {self.size}/{self.max_bytes} "
            f"bytes, {len(self._owners)} owners, ttl={self.ttl:g}s)"
        )
