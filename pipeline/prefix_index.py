"""PrefixIndex: which worker holds which cached prompt blocks, and KV events that update it.

Engines that cache prompt prefixes report them as *blocks*, each named by a chained id:
a block's id covers every block before it, so one id names a whole prefix (the LLM layer
makes them with ``operators.routing.kv_blocks``). The index sees only opaque hashable block ids and
worker ids (str); it knows nothing of tokens or engines.

Because ids are chained, the index needs no tree: a flat map from block id to the set of
workers holding it *is* the prefix tree, flattened. :meth:`PrefixIndex.overlaps` walks a
request's ids in order, narrowing the set of workers that still hold every block so far;
the walk ends at the first block no candidate holds, so it costs one dict lookup per
request block the best worker holds (plus set work for workers dropping out), never
anything proportional to the index size.

Holder sets are interned frozensets: blocks held by the same workers share one object, so
the common step of the walk (the next block has the same holders) is an identity check,
and an index of 100k blocks stores one dict entry per block, not one set per block.

Once the walk is down to one or two workers (a conversation's history usually lives on
one), it follows each worker's *runs* instead: the blocks a worker stored together, in
the order it stored them. A run is compared with the request as two list slices, which costs a
tenth of a dict lookup per block, so a fully cached 4k-token prompt costs a few lookups
and a slice comparison instead of 256 lookups (``benchmarks/bench_kv_index.py``).
Correctness does not rest on runs being chains: the index keeps every block of a run's
live range held by its worker (an eviction inside a run splits it), so equal slices mean
held blocks.

Engines report changes as events (:mod:`pipeline.kv_events`, re-exported here).
:meth:`PrefixIndex.apply` applies one and keeps each worker's events in order by
their ``seq``: a gap means events were missed, and ``apply`` answers False until a
snapshot from the worker catches the index up (events that arrive while it is awaited are
replayed after it).

**Tiers.** An engine may keep blocks below its working cache, in host memory or on disk
(:mod:`pipeline.kv_tier`), and report them with the event's ``tier``. The index keeps one
holder map per tier: :meth:`overlaps` answers for the device tier (the blocks a worker
can use at once), :meth:`tiered_overlaps` also counts the blocks that continue a
worker's leading run from its lower tiers (restored before use, which is cheaper than
prefilling them but not free). A worker's events are numbered across all its tiers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Final, final

from .kv_events import (
    DEVICE_TIER,
    BlockId,
    KvCleared,
    KvEvent,
    KvRemoved,
    KvSnapshot,
    KvStored,
    event_from_dict,
)

__all__ = (
    "KvCleared",
    "KvEvent",
    "KvRemoved",
    "KvSnapshot",
    "KvStored",
    "PrefixIndex",
    "event_from_dict",
)

_NOBODY: Final[frozenset[str]] = frozenset()

#: interned holder sets kept before the intern tables are rebuilt (they only speed up
#: updates and queries; correctness never depends on two equal sets being one object)
_INTERN_LIMIT = 1 << 16

#: events kept per worker while a snapshot is awaited; beyond it they are dropped and the
#: next snapshot's successor events show a gap again (another snapshot is asked for)
PENDING_LIMIT = 1 << 16

#: the walk follows each worker's runs once this few workers are left: the walk costs a
#: dict lookup per block for all of them, following costs a few list comparisons per
#: worker (measured: 1-2 is best at 4 and 16 workers; more is slower on shared prefixes)
_FOLLOW = 2


class _Run:
    """Blocks one worker stored in one call, in order; it holds all of ``ids[start:end]``."""

    __slots__ = ("end", "ids", "start")

    def __init__(self, ids: list[BlockId], start: int, end: int) -> None:
        self.ids = ids
        self.start = start
        self.end = end


@dataclass(slots=True)
class _Sequence:
    """A worker's event order: the last applied seq, and events held while out of sync."""

    last: int = 0
    pending: list[KvEvent] | None = None  # not None: a gap was seen, a snapshot is awaited
    dropped: int = 0  # the highest seq left out of ``pending`` (it was full)


@final
class PrefixIndex:
    """Which workers hold which blocks; per request, how many leading blocks each holds.

    Not thread-safe: one event loop owns it (events and routing decisions both run there).
    """

    def __init__(self) -> None:
        self._holders: dict[BlockId, frozenset[str]] = {}
        # worker -> block -> (the run holding it, its position in the run's ids)
        self._blocks: dict[str, dict[BlockId, tuple[_Run, int]]] = {}
        # holder set -> holder set with/without a worker, per worker; values interned
        self._plus: dict[str, dict[frozenset[str], frozenset[str]]] = {}
        self._minus: dict[str, dict[frozenset[str], frozenset[str]]] = {}
        self._interned: dict[frozenset[str], frozenset[str]] = {}
        self._sequences: dict[str, _Sequence] = {}
        #: the lower tiers' holdings ("host", "disk"), one plain index each
        self._lower: dict[str, PrefixIndex] = {}

    # -- queries ------------------------------------------------------------------------------

    def overlaps(self, block_ids: Sequence[BlockId]) -> dict[str, int]:
        """For each worker holding the first block, how many leading blocks it holds.

        Workers holding none of the request's leading blocks are absent (count 0).
        """
        holders = self._holders.get
        result: dict[str, int] = {}
        active: frozenset[str] | None = None
        depth = 0
        for depth, block in enumerate(block_ids):
            held = holders(block)
            if held is None:
                break
            if held is active:
                continue
            if active is None:
                active = held
            elif not active <= held:
                still = active & held
                for worker in active - still:
                    result[worker] = depth
                if not still:
                    return result
                # the interned set when there is one: the next blocks are likely held by
                # exactly these workers, and then the identity check above is enough
                active = self._interned.get(still, still)
            if len(active) <= _FOLLOW:
                ids = block_ids if isinstance(block_ids, list) else list(block_ids)
                for worker in active:
                    result[worker] = self._follow(self._blocks[worker], ids, depth)
                return result
        else:
            depth = len(block_ids)
        if active is not None:
            for worker in active:
                result[worker] = depth
        return result

    @staticmethod
    def _follow(mine: dict[BlockId, tuple[_Run, int]], ids: list[BlockId], depth: int) -> int:
        """How far the worker whose blocks are ``mine`` holds ``ids`` on from ``depth``."""
        total = len(ids)
        while depth < total:
            entry = mine.get(ids[depth])
            if entry is None:
                break
            run, at = entry
            length = min(run.end - at, total - depth)
            held = run.ids
            # Compare in growing pieces, then halve the piece that differs: the cost stays
            # proportional to how far the request follows the run (a slice copies, and
            # touches, every block in it), not to the run's length.
            good, piece = 1, 16  # the first block matched in the lookup
            while good < length:
                bad = min(good + piece, length)
                if ids[depth + good : depth + bad] == held[at + good : at + bad]:
                    good, piece = bad, piece * 2
                    continue
                while bad - good > 1:
                    middle = (good + bad) // 2
                    if ids[depth + good : depth + middle] == held[at + good : at + middle]:
                        good = middle
                    else:
                        bad = middle
                break
            depth += good
        return depth

    def tiered_overlaps(self, block_ids: Sequence[BlockId]) -> dict[str, tuple[int, int]]:
        """For each worker holding the first block in some tier: ``(device, lower)``, the
        leading blocks it holds on the device, and how many more leading blocks after
        them it holds in its lower tiers (the two add up to its leading run over all
        tiers, which may switch tiers block by block).

        Without lower tiers this is :meth:`overlaps` with ``lower`` 0.
        """
        device = self.overlaps(block_ids)
        if not self._lower or not block_ids:
            return {worker: (held, 0) for worker, held in device.items()}
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        first = ids[0]
        candidates = set(device)
        for tier in self._lower.values():
            candidates.update(tier.holders(first))
        result: dict[str, tuple[int, int]] = {}
        indexes = (self, *self._lower.values())
        for worker in candidates:
            start = device.get(worker, 0)
            depth = start
            moved = True
            while moved and depth < len(ids):
                moved = False
                for index in indexes:
                    further = index._run_from(worker, ids, depth)
                    if further > depth:
                        depth, moved = further, True
            result[worker] = (start, depth - start)
        return result

    def _run_from(self, worker: str, ids: list[BlockId], depth: int) -> int:
        """How far ``worker`` holds ``ids`` from ``depth`` on, in this index."""
        mine = self._blocks.get(worker)
        return self._follow(mine, ids, depth) if mine else depth

    def blocks(self, worker: str, tier: str = DEVICE_TIER) -> int:
        """How many blocks ``worker`` holds in ``tier``."""
        if tier != DEVICE_TIER:
            lower = self._lower.get(tier)
            return 0 if lower is None else lower.blocks(worker)
        return len(self._blocks.get(worker, ()))

    def unique_blocks(self, worker: str) -> int:
        """How many device blocks ``worker`` alone holds: what its KV cache would take
        with it if it left (a planner drains the worker that holds the fewest)."""
        holders = self._holders
        return sum(1 for block in self._blocks.get(worker, ()) if len(holders[block]) == 1)

    def workers(self) -> frozenset[str]:
        """The workers holding at least one block on the device."""
        return frozenset(worker for worker, held in self._blocks.items() if held)

    def holders(self, block_id: BlockId, tier: str = DEVICE_TIER) -> frozenset[str]:
        """The workers holding ``block_id`` in ``tier``."""
        if tier != DEVICE_TIER:
            lower = self._lower.get(tier)
            return _NOBODY if lower is None else lower.holders(block_id)
        return self._holders.get(block_id, _NOBODY)

    def tiers(self) -> frozenset[str]:
        """The lower tiers some worker reported blocks in (the device tier not included)."""
        return frozenset(name for name, index in self._lower.items() if len(index))

    def __len__(self) -> int:
        """How many distinct blocks some worker holds."""
        return len(self._holders)

    # -- updates ------------------------------------------------------------------------------

    def stored(self, worker: str, block_ids: Iterable[BlockId]) -> None:
        """``worker`` now holds ``block_ids`` (already held ones are no change)."""
        mine = self._blocks.setdefault(worker, {})
        given = block_ids if isinstance(block_ids, list) else list(block_ids)
        new = [block for block in given if block not in mine]
        if not new:
            return
        first = given.index(new[0])
        if given[first : first + len(new)] == new and len(set(new)) == len(new):
            # the usual event: a held prefix (or none), then new blocks in a row
            run = _Run(new, 0, len(new))
            count = len(new)
            mine.update(zip(new, zip(repeat(run, count), range(count), strict=True), strict=True))
        else:
            self._new_runs(mine, given)
        plus = self._plus.setdefault(worker, {})
        holders = self._holders
        get = holders.get
        # Neighbouring blocks mostly have the same holders: reuse the last transition.
        last_before: frozenset[str] | None = None
        after = _NOBODY
        for block in new:
            before = get(block, _NOBODY)
            if before is not last_before:
                last_before = before
                found = plus.get(before)
                if found is None:
                    found = plus[before] = self._intern(before | {worker})
                after = found
            holders[block] = after

    @staticmethod
    def _new_runs(mine: dict[BlockId, tuple[_Run, int]], given: list[BlockId]) -> None:
        """Record ``given``'s new blocks in ``mine``, a run for each stretch of them."""
        run: _Run | None = None
        for block in given:
            if block in mine:
                run = None  # a run is what was new in a row
                continue
            if run is None:
                run = _Run([], 0, 0)
            mine[block] = (run, run.end)
            run.ids.append(block)
            run.end += 1

    def removed(self, worker: str, block_ids: Iterable[BlockId]) -> None:
        """``worker`` no longer holds ``block_ids`` (unknown ones are ignored)."""
        mine = self._blocks.get(worker)
        if not mine:
            return
        gone = []
        for block in block_ids:
            entry = mine.pop(block, None)
            if entry is None:
                continue
            gone.append(block)
            run, at = entry
            if at == run.end - 1:
                run.end = at
            elif at == run.start:
                run.start = at + 1
            else:  # split the run; the smaller side moves to a new one
                ids = run.ids
                if run.end - at <= at - run.start:
                    part = _Run(ids, at + 1, run.end)
                    run.end = at
                else:
                    part = _Run(ids, run.start, at)
                    run.start = at + 1
                for position in range(part.start, part.end):
                    mine[ids[position]] = (part, position)
        self._drop(worker, gone)

    def cleared(self, worker: str) -> None:
        """``worker`` holds nothing any more."""
        mine = self._blocks.get(worker)
        if mine:
            self._drop(worker, list(mine))
            mine.clear()

    def snapshot(self, worker: str, block_ids: Iterable[BlockId]) -> None:
        """``worker`` holds exactly ``block_ids``: replaces what the index believed."""
        ordered = list(block_ids)  # in their order: runs follow it
        mine = self._blocks.get(worker)
        if mine:
            wanted = set(ordered)
            self.removed(worker, [block for block in mine if block not in wanted])
        self.stored(worker, ordered)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker``: its blocks in every tier and its event order (it left, or
        died)."""
        for lower in self._lower.values():
            lower.remove_worker(worker)
        self.cleared(worker)
        self._blocks.pop(worker, None)
        self._plus.pop(worker, None)
        self._minus.pop(worker, None)
        self._sequences.pop(worker, None)

    def _drop(self, worker: str, blocks: list[BlockId]) -> None:
        """Take ``worker`` out of the holders of ``blocks`` (its own map is done already)."""
        minus = self._minus.setdefault(worker, {})
        holders = self._holders
        for block in blocks:
            before = holders[block]
            after = minus.get(before)
            if after is None:
                after = minus[before] = self._intern(before - {worker})
            if after:
                holders[block] = after
            else:
                del holders[block]

    def _intern(self, holders: frozenset[str]) -> frozenset[str]:
        if len(self._interned) >= _INTERN_LIMIT:
            # Rare (it takes 65k distinct holder sets): start the tables afresh. Sets made
            # before stay valid; they are only no longer shared with new ones.
            self._interned.clear()
            self._plus.clear()
            self._minus.clear()
        return self._interned.setdefault(holders, holders)

    # -- events -------------------------------------------------------------------------------

    def apply(self, worker: str, event: KvEvent) -> bool:
        """Apply ``worker``'s ``event``; False while events from it are known to be missing.

        Events with a ``seq`` are kept in order per worker, numbered 1, 2, ... from the
        worker's start (a snapshot carries the seq of the last event it reflects; 0 before
        the first). An event at or below the last applied seq is a duplicate or predates
        the snapshot and is ignored. One that skips numbers (a frontend that started late,
        or lost messages) is applied anyway, as the best guess, and from then on ``apply``
        returns False: ask the worker for a :class:`KvSnapshot`. Events arriving until it
        comes are kept and replayed on top of it, so the index then equals the worker's
        cache again. Events without a ``seq`` are applied as they come and never report a
        gap. A snapshot older than the events already applied in order is ignored.

        Worker ids must not be reused by a restarted worker whose numbering starts again
        at 1 (its events would look like duplicates) unless it was :meth:`remove_worker`-ed
        in between: discovery ids that include a per-process nonce (a lease id) do that.
        """
        seq = event.seq
        if seq is None:
            self._apply(worker, event)
            order = self._sequences.get(worker)
            return order is None or order.pending is None
        order = self._sequences.get(worker)
        if order is None:
            order = self._sequences[worker] = _Sequence()
        if isinstance(event, KvSnapshot):
            return self._caught_up(worker, order, event, seq)
        if order.pending is not None:
            if seq > order.last:
                self._apply(worker, event)  # the best guess until the snapshot arrives
                if len(order.pending) < PENDING_LIMIT:
                    order.pending.append(event)
                else:
                    order.dropped = max(order.dropped, seq)
            return False
        if seq <= order.last:
            return True
        self._apply(worker, event)
        if seq != order.last + 1:
            order.pending = [event]
            return False
        order.last = seq
        return True

    def _caught_up(self, worker: str, order: _Sequence, snapshot: KvSnapshot, seq: int) -> bool:
        if order.pending is None and seq <= order.last:
            return True  # an old snapshot: what it says was already applied event by event
        later = sorted(
            (event for event in order.pending or () if (event.seq or 0) > seq),
            key=lambda event: event.seq or 0,
        )
        self._apply(worker, snapshot)
        order.last, order.pending = seq, None
        for index, event in enumerate(later):
            if event.seq == order.last:
                continue  # the same event delivered twice
            if event.seq != order.last + 1:  # still a gap: replay the rest as the best guess
                order.pending = later[index:]
                for guess in order.pending:
                    self._apply(worker, guess)
                return False
            self._apply(worker, event)
            order.last = event.seq
        if order.dropped > order.last:  # the replay falls short of what was dropped
            order.pending = []
            return False
        order.dropped = 0
        return True

    def _apply(self, worker: str, event: KvEvent) -> None:
        if isinstance(event, KvSnapshot):
            given = dict(event.tiers)
            for name in set(self._lower) | set(given):
                self._tier(name).snapshot(worker, given.get(name, ()))
            self.snapshot(worker, event.block_ids)
            return
        index = self if event.tier == DEVICE_TIER else self._tier(event.tier)
        if isinstance(event, KvStored):
            index.stored(worker, event.block_ids)
        elif isinstance(event, KvRemoved):
            index.removed(worker, event.block_ids)
        else:
            index.cleared(worker)

    def _tier(self, name: str) -> PrefixIndex:
        lower = self._lower.get(name)
        if lower is None:
            lower = self._lower[name] = PrefixIndex()
        return lower

    def __repr__(self) -> str:
        counts = {worker: len(held) for worker, held in self._blocks.items() if held}
        lower = "".join(f", {name}: {index!r}" for name, index in self._lower.items() if len(index))
        return f"PrefixIndex({len(self._holders)} blocks, {counts}{lower})"
