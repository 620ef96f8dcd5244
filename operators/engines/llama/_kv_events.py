"""The KV events of the llama engine: the full blocks its slots' cells really hold.

A KV router (issue 16) routes a request to the worker that holds most of its prompt's
leading blocks, so the engine reports what it holds as :mod:`operators.routing.kv_blocks` ids: the
union, over slots, of the full blocks of ``runtime.cached[slot]`` (a free slot keeps its
cells as a prefix cache, and generated tokens in them are a real prefix for the next turn
of a chat). Two slots may hold the same prefix, so blocks are reference-counted by slot: a
block is *stored* when the first slot comes to hold it and *removed* when the last lets go.

Two halves, because two threads are involved:

- :class:`KvLedger`, the scheduler thread's: the runtime marks where it cut a slot's cells
  (:meth:`~KvLedger.truncated`, a copy, a clear; one ``min`` each, paid whether or not
  anyone listens) and :meth:`~KvLedger.sync` turns what changed since the last call into
  events. Extensions need no mark: a slot's cells grow only at the end, so its length
  says how far it grew. A slot's ids extend incrementally (the new blocks are hashed with
  the last kept id as parent), so a decode step hashes a block once in ``block_size``
  steps, and a sync with nothing new is a few comparisons per slot.
- :class:`KvReporter`, the event loop's: the sink is called on the event loop
  (``engine.kv_events``, as the mocker's), never from the scheduler thread. It is a
  :class:`~operators.engines._kv_delivery.KvDelivery` (shared with the vLLM engine): events
  wait in a deque until the loop drains them; the scheduler asks the loop to, without
  waiting for it (a scheduler that waited for a busy loop would stall every sequence of the
  batch, see ``_job``). They are numbered as they are delivered, and
  :meth:`~KvReporter.snapshot` always equals the events delivered so far, with their last
  ``seq``.

Nothing is hashed or queued while no sink is set (the default): the scheduler checks one
attribute per step. A sink set later gets everything already cached as one
:class:`~pipeline.KvStored` at the next sync (after its consumer applied a snapshot).

The engine's KV tiers (host memory, disk: :mod:`pipeline.kv_tier`) report their blocks
too, with their tier's name: :class:`TierLedger` records what each tier reports (in the
scheduler thread, where the tiers are used) and turns the net change since the last sync
into events, so the reporter numbers the device's and the tiers' events as one sequence
and its snapshot holds every tier.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import Final, final

from operators.engines._kv_delivery import KvDelivery
from operators.routing.kv_blocks import block_hashes
from pipeline import KvCleared, KvEvent, KvRemoved, KvStored, KvTier

__all__ = ("KvLedger", "KvReporter", "TierLedger")

#: a slot not cut since the last sync
_UNCUT: Final = sys.maxsize


@final
class KvLedger:
    """The blocks each slot holds as of the last :meth:`sync`, reference-counted.

    Owned by the scheduler thread (the runtime calls the marks, the scheduler syncs).
    """

    __slots__ = ("_cleared", "_cut", "_ids", "_refs", "_salts", "block_size")

    def __init__(self, slots: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._ids: list[list[int]] = [[] for _ in range(slots)]
        self._cut = [_UNCUT] * slots  # the shortest length each slot was cut to
        self._refs: dict[int, int] = {}  # block -> slots holding it
        self._salts: list[int | None] = [None] * slots  # each slot's first parent
        self._cleared = False

    # ------------------------------------------------------- marks (from the runtime)

    def truncated(self, slot: int, length: int) -> None:
        """Slot ``slot``'s cells from ``length`` on were dropped (or replaced)."""
        if length < self._cut[slot]:
            self._cut[slot] = length

    def salted(self, slot: int, salt: int | None) -> None:
        """Slot ``slot`` holds cells of another adapter from now on (``salt``: its
        :func:`~operators.routing.kv_blocks.adapter_salt`, the first block's parent; None:
        the base model's). Its cells were cut to nothing already."""
        if self._salts[slot] != salt:
            self._salts[slot] = salt
            self.truncated(slot, 0)

    def cleared(self) -> None:
        """Every slot was emptied at once."""
        self._cleared = True
        self._cut = [0] * len(self._cut)

    # ------------------------------------------------------------------------ syncing

    def sync(self, cached: Sequence[Sequence[int]]) -> list[KvEvent]:
        """Events (unnumbered) taking the held blocks to those of ``cached`` now.

        At most one :class:`KvCleared`, then one :class:`KvRemoved`, then one
        :class:`KvStored` (its ids in prefix order: each block's parent is held already or
        comes before it). A block moving from one slot to another in between is no event.
        """
        events: list[KvEvent] = []
        refs = self._refs
        if self._cleared:
            self._cleared = False
            if refs:
                events.append(KvCleared())
            refs.clear()
            for ids in self._ids:
                ids.clear()
        size = self.block_size
        stored: list[int] = []
        dropped: list[int] = []
        cut = self._cut
        for slot, (tokens, ids) in enumerate(zip(cached, self._ids, strict=True)):
            full = len(tokens) // size
            mark = cut[slot]
            if mark == _UNCUT:
                if full == len(ids):
                    continue  # the usual decode step: no block completed, nothing cut
                kept = min(len(ids), full)
            else:
                kept = min(len(ids), full, mark // size)
                cut[slot] = _UNCUT
            if kept < len(ids):
                dropped.extend(ids[kept:])
                del ids[kept:]
            if full > kept:
                new = block_hashes(
                    tokens[kept * size : full * size],
                    size,
                    parent=ids[-1] if ids else self._salts[slot],
                )
                ids.extend(new)
                for block in new:  # counted up before any count goes down: see below
                    count = refs.get(block, 0)
                    refs[block] = count + 1
                    if not count:
                        stored.append(block)
        # Dropped blocks were counted before this sync and stored ones were not, so the two
        # lists are disjoint, and a block that changed slots never reached zero.
        removed: list[int] = []
        for block in dropped:
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]
                removed.append(block)
        if removed:
            events.append(KvRemoved(tuple(removed)))
        if stored:
            events.append(KvStored(tuple(stored)))
        return events

    def held(self) -> set[int]:
        """Every block some slot holds, as of the last sync (for tests)."""
        return set(self._refs)

    def slot_ids(self, slot: int) -> list[int]:
        """Slot ``slot``'s block ids as of the last sync (for tests)."""
        return list(self._ids[slot])


#: blocks touched since the last sync beyond which a tier's next sync compares whole sets
#: (while nobody listens, nothing syncs; the touched set must not grow without bound)
_TOUCHED_LIMIT: Final = 1 << 16


@final
class TierLedger:
    """What each KV tier holds, as its own events say, and what was reported of it.

    The tiers call :meth:`record` (it is their ``on_event``) from the scheduler thread;
    :meth:`sync` returns the events of the net change since the last sync, one
    ``KvRemoved`` and one ``KvStored`` per tier at most. Blocks a tier held when it was
    given (a disk tier's files from an earlier run) count as changes at the first sync.
    """

    __slots__ = ("_held", "_reported", "_touched", "_whole")

    def __init__(self, tiers: Sequence[KvTier]) -> None:
        self._held: dict[str, dict[Hashable, None]] = {}
        self._reported: dict[str, set[Hashable]] = {}
        self._touched: dict[str, dict[Hashable, None]] = {}
        self._whole: set[str] = set()
        for tier in tiers:
            held = dict.fromkeys(tier.block_ids())
            self._held[tier.name] = held
            self._reported[tier.name] = set()
            self._touched[tier.name] = dict(held)
            tier.on_event = self.record

    def record(self, event: KvEvent) -> None:
        """A tier's event: a block came or went."""
        if not isinstance(event, KvStored | KvRemoved):
            return
        tier = event.tier
        held = self._held.setdefault(tier, {})
        self._reported.setdefault(tier, set())
        touched = self._touched.setdefault(tier, {})
        for block in event.block_ids:
            if isinstance(event, KvStored):
                held[block] = None
            else:
                held.pop(block, None)
            touched.pop(block, None)
            touched[block] = None
        if len(touched) > _TOUCHED_LIMIT:
            touched.clear()
            self._whole.add(tier)

    def sync(self) -> list[KvEvent]:
        """The events taking what was reported to what the tiers hold now."""
        events: list[KvEvent] = []
        for tier, held in self._held.items():
            reported = self._reported[tier]
            if tier in self._whole:
                self._whole.discard(tier)
                blocks: dict[Hashable, None] | set[Hashable] = {**held, **dict.fromkeys(reported)}
            else:
                blocks = self._touched[tier]
            removed = [block for block in blocks if block in reported and block not in held]
            stored = [block for block in blocks if block in held and block not in reported]
            self._touched[tier] = {}
            reported.difference_update(removed)
            reported.update(stored)
            if removed:
                events.append(KvRemoved(tuple(removed), tier=tier))
            if stored:
                events.append(KvStored(tuple(stored), tier=tier))
        return events

    def held(self, tier: str) -> set[Hashable]:
        """What ``tier`` holds as its events say (for tests)."""
        return set(self._held.get(tier, ()))


@final
class KvReporter(KvDelivery):
    """Delivers a :class:`KvLedger`'s events to ``sink`` on the event loop, numbered
    (:class:`~operators.engines._kv_delivery.KvDelivery`): the scheduler thread calls
    :meth:`sync`, the event loop sets the sink and asks for snapshots."""

    __slots__ = ("ledger", "tiers")

    def __init__(self, ledger: KvLedger, tiers: TierLedger | None = None) -> None:
        super().__init__()
        self.ledger = ledger
        #: the KV tiers' ledger (None: no tiers)
        self.tiers = tiers

    def sync(self, cached: Sequence[Sequence[int]]) -> None:
        """Queue what changed in ``cached`` since the last sync, and have the event loop
        deliver it. Call it only while :attr:`sink` is set: it is what tracking costs."""
        events = self.ledger.sync(cached)
        if self.tiers is not None:
            events += self.tiers.sync()
        if events:
            self.push(events)
