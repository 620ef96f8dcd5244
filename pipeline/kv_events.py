"""KV events: what an engine that caches prompt prefixes reports about its cache.

Blocks are named by chained ids (a block's id covers every block before it; the LLM layer
makes them with ``operators.routing.kv_blocks``); the events say which blocks a worker stored,
evicted, or holds in all (a snapshot). They are plain dataclasses of ints, strings and
tuples, so a transport serializes them with :meth:`to_dict` / :func:`event_from_dict`
(msgpack or JSON), and :class:`~pipeline.prefix_index.PrefixIndex` applies them. Apart from
the index so that an engine or a transport can speak them without the index itself.

Every event names the **tier** it is about: ``"device"`` (the default) is the engine's
working cache, where a held block costs nothing to reuse; lower tiers (``"host"`` memory,
``"disk"``, see :mod:`pipeline.kv_tier`) hold blocks that must be restored before use. A
block may be in several tiers at once; each tier's holdings are separate sets, and a
snapshot carries them all.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, TypeAlias, final

__all__ = (
    "DEVICE_TIER",
    "BlockId",
    "KvCleared",
    "KvEvent",
    "KvEventSink",
    "KvRemoved",
    "KvSnapshot",
    "KvStored",
    "event_from_dict",
)

#: a block id: opaque to the index (the LLM layer uses unsigned 64-bit ints)
BlockId: TypeAlias = Hashable

#: the tier of an engine's working KV cache (its slots, its GPU memory): the default
DEVICE_TIER: Final = "device"


class _Event:
    """What KV events share: a ``kind`` tag, and a plain dict for transports."""

    __slots__ = ()
    kind: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of ints, strs and lists (see :func:`event_from_dict`)."""
        plain: dict[str, Any] = {"kind": self.kind, "seq": getattr(self, "seq", None)}
        if isinstance(self, KvStored | KvRemoved | KvSnapshot):
            plain["block_ids"] = list(self.block_ids)
        tier = getattr(self, "tier", DEVICE_TIER)
        if tier != DEVICE_TIER:  # the default stays off the wire: older peers read it unchanged
            plain["tier"] = tier
        if isinstance(self, KvSnapshot) and self.tiers:
            plain["tiers"] = {name: list(ids) for name, ids in self.tiers}
        return plain


@final
@dataclass(frozen=True, slots=True)
class KvStored(_Event):
    """The worker now holds these blocks in ``tier`` (in prefix order; ids chained)."""

    kind: ClassVar[Literal["stored"]] = "stored"
    block_ids: tuple[BlockId, ...]
    #: the worker's event number (1, 2, ...) for loss detection; None: not sequenced
    seq: int | None = None
    #: where: :data:`DEVICE_TIER` (the working cache) or a lower tier ("host", "disk")
    tier: str = DEVICE_TIER


@final
@dataclass(frozen=True, slots=True)
class KvRemoved(_Event):
    """The worker evicted these blocks from ``tier``."""

    kind: ClassVar[Literal["removed"]] = "removed"
    block_ids: tuple[BlockId, ...]
    seq: int | None = None
    tier: str = DEVICE_TIER


@final
@dataclass(frozen=True, slots=True)
class KvCleared(_Event):
    """The worker dropped its whole cache in ``tier``."""

    kind: ClassVar[Literal["cleared"]] = "cleared"
    seq: int | None = None
    tier: str = DEVICE_TIER


@final
@dataclass(frozen=True, slots=True)
class KvSnapshot(_Event):
    """Everything the worker holds, as of its event ``seq`` (0: before its first event).

    Replaces what the index believed of the worker: the answer to a snapshot request from
    a frontend that started late or saw a gap. ``block_ids`` are the device tier's;
    ``tiers`` the lower tiers', as ``(name, block ids)`` pairs (a tier absent from them
    holds nothing).
    """

    kind: ClassVar[Literal["snapshot"]] = "snapshot"
    block_ids: tuple[BlockId, ...]
    seq: int | None = None
    tiers: tuple[tuple[str, tuple[BlockId, ...]], ...] = ()


KvEvent: TypeAlias = KvStored | KvRemoved | KvCleared | KvSnapshot

KvEventSink: TypeAlias = Callable[[KvEvent], None]
"""Where an engine reports its KV events as they happen (its ``kv_events`` attribute): called
on the event loop, so it must be quick (apply to an index, or buffer for a transport)."""


def event_from_dict(data: Mapping[str, Any]) -> KvEvent:
    """The event ``to_dict()`` made (block id lists become tuples).

    Raises:
        ValueError: an unknown ``kind``.
    """
    kind = data.get("kind")
    seq = data.get("seq")
    tier = str(data.get("tier", DEVICE_TIER))
    if kind == "cleared":
        return KvCleared(seq, tier)
    ids = tuple(data.get("block_ids", ()))
    if kind == "stored":
        return KvStored(ids, seq, tier)
    if kind == "removed":
        return KvRemoved(ids, seq, tier)
    if kind == "snapshot":
        tiers = data.get("tiers") or {}
        return KvSnapshot(ids, seq, tuple((str(name), tuple(held)) for name, held in tiers.items()))
    raise ValueError(f"unknown KV event kind {kind!r}")
