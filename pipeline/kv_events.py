"""KV events: what an engine that caches prompt prefixes reports about its cache.

Blocks are named by chained ids (a block's id covers every block before it; the LLM layer
makes them with ``operators.routing.kv_blocks``); the events say which blocks a worker stored,
evicted, or holds in all (a snapshot). They are plain dataclasses of ints, strings and
tuples, so a transport serializes them with :meth:`to_dict` / :func:`event_from_dict`
(msgpack or JSON), and :class:`~pipeline.prefix_index.PrefixIndex` applies them. Apart from
the index so that an engine or a transport can speak them without the index itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias, final

__all__ = (
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


class _Event:
    """What KV events share: a ``kind`` tag, and a plain dict for transports."""

    __slots__ = ()
    kind: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of ints, strs and lists (see :func:`event_from_dict`)."""
        plain: dict[str, Any] = {"kind": self.kind, "seq": getattr(self, "seq", None)}
        if isinstance(self, KvStored | KvRemoved | KvSnapshot):
            plain["block_ids"] = list(self.block_ids)
        return plain


@final
@dataclass(frozen=True, slots=True)
class KvStored(_Event):
    """The worker now holds these blocks (in prefix order; ids chained)."""

    kind: ClassVar[Literal["stored"]] = "stored"
    block_ids: tuple[BlockId, ...]
    #: the worker's event number (1, 2, ...) for loss detection; None: not sequenced
    seq: int | None = None


@final
@dataclass(frozen=True, slots=True)
class KvRemoved(_Event):
    """The worker evicted these blocks."""

    kind: ClassVar[Literal["removed"]] = "removed"
    block_ids: tuple[BlockId, ...]
    seq: int | None = None


@final
@dataclass(frozen=True, slots=True)
class KvCleared(_Event):
    """The worker dropped its whole cache."""

    kind: ClassVar[Literal["cleared"]] = "cleared"
    seq: int | None = None


@final
@dataclass(frozen=True, slots=True)
class KvSnapshot(_Event):
    """Everything the worker holds, as of its event ``seq`` (0: before its first event).

    Replaces what the index believed of the worker: the answer to a snapshot request from
    a frontend that started late or saw a gap.
    """

    kind: ClassVar[Literal["snapshot"]] = "snapshot"
    block_ids: tuple[BlockId, ...]
    seq: int | None = None


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
    if kind == "cleared":
        return KvCleared(seq)
    ids = tuple(data.get("block_ids", ()))
    if kind == "stored":
        return KvStored(ids, seq)
    if kind == "removed":
        return KvRemoved(ids, seq)
    if kind == "snapshot":
        return KvSnapshot(ids, seq)
    raise ValueError(f"unknown KV event kind {kind!r}")
