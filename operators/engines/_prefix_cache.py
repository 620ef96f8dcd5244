"""The mocker's simulated prefix cache: which prompt blocks a worker holds, and its KV events.

Apart from :class:`~operators.engines.mocker.MockerEngine` so that the cache's bookkeeping
(LRU order, capacity, the events it reports) is testable without a step clock, and the
engine only asks two questions: how many leading tokens of this prompt are cached
(:meth:`PrefixCache.lookup`), and "this prompt was prefilled" (:meth:`PrefixCache.store`).

Blocks are named by :func:`operators.routing.kv_blocks.block_hashes`, the ids the KV router
computes for the same tokens, so the events need no translation on their way to a
:class:`~pipeline.prefix_index.PrefixIndex`.

Eviction is LRU by block, as vLLM's free-block queue: a prompt's blocks are touched last
block first, so a prefix's first block is always more recent than its later blocks and
the tail goes first. Every block's parent is therefore held whenever the block is (the
cache is prefix-closed), which is what makes a held block reusable at all: an engine can
only reuse a block when it holds every block before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, final

from operators.routing.kv_blocks import adapter_salt, block_hashes
from pipeline import KvCleared, KvEvent, KvEventSink, KvRemoved, KvSnapshot, KvStored

__all__ = ("DEFAULT_BLOCK_SIZE", "DEFAULT_CACHE_BLOCKS", "KvEventSink", "PrefixCache")

#: tokens per block, as the KV router's ``--kv-block-size`` default
DEFAULT_BLOCK_SIZE: Final = 16
#: blocks a mocker caches by default (64k tokens of 16)
DEFAULT_CACHE_BLOCKS: Final = 4096

#: where a cache reports its events: called synchronously, on the engine's event loop


@final
class PrefixCache:
    """A worker's cached prompt blocks, LRU-evicted at ``capacity`` blocks.

    Events are numbered 1, 2, ... (``seq``) so a :class:`~pipeline.prefix_index.PrefixIndex`
    detects a lost one; :meth:`snapshot` carries the number of the last event it reflects.

    Args:
        block_size: tokens per block (must equal the router's).
        capacity: most blocks held (at least 1).
        sink: receives every event; None: events are only numbered (set it later with
            :attr:`sink`, then send a :meth:`snapshot` first).
    """

    __slots__ = (
        "_blocks",
        "_seq",
        "block_size",
        "cached_tokens",
        "capacity",
        "computed_tokens",
        "sink",
    )

    def __init__(self, block_size: int, capacity: int, sink: KvEventSink | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self.sink = sink
        #: prompt tokens prefilled (not found in the cache) so far
        self.computed_tokens = 0
        #: prompt tokens found in the cache so far
        self.cached_tokens = 0
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._seq = 0

    def __len__(self) -> int:
        """How many blocks are held."""
        return len(self._blocks)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._blocks

    def block_ids(self, token_ids: Sequence[int], adapter: str | None = None) -> list[int]:
        """The chained ids of the full blocks of ``token_ids`` (salted by ``adapter``: a
        prefix cached under one adapter is another prefix under any other)."""
        return block_hashes(token_ids, self.block_size, parent=adapter_salt(adapter))

    def held(self, blocks: Sequence[int]) -> int:
        """How many leading ``blocks`` the cache holds now (a look: nothing is touched or
        counted; the load report's estimate of a queued prompt)."""
        held = self._blocks
        hit = 0
        for block in blocks:
            if block not in held:
                break
            hit += 1
        return hit

    def lookup(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """Prompt tokens of a request found in the cache: its leading held blocks.

        Touches those blocks (they are about to be read) and counts the request's computed
        and cached tokens; ``prompt_tokens`` is the request's whole prefill.
        """
        hit = self.held(blocks)
        self._touch(blocks[:hit])
        cached = min(hit * self.block_size, prompt_tokens)
        self.cached_tokens += cached
        self.computed_tokens += prompt_tokens - cached
        return cached

    def store(self, blocks: Sequence[int]) -> None:
        """Hold a prefilled prompt's blocks (its first ``capacity``), evicting LRU blocks.

        Emits :class:`KvRemoved` for the evicted blocks, then :class:`KvStored` for the new
        ones, in prefix order.
        """
        blocks = blocks[: self.capacity]
        held = self._blocks
        self._touch([block for block in blocks if block in held])
        new = [block for block in blocks if block not in held]
        excess = len(held) + len(new) - self.capacity
        if excess > 0:
            # The prompt's own held blocks were just touched, and it fits: none is evicted.
            evicted = [held.popitem(last=False)[0] for _ in range(excess)]
            self._emit(KvRemoved(tuple(evicted), self._next_seq()))
        if new:
            for block in reversed(new):
                held[block] = None
            self._touch(blocks)
            self._emit(KvStored(tuple(new), self._next_seq()))

    def clear(self) -> None:
        """Drop every block (a reset of the simulated worker)."""
        self._blocks.clear()
        self._emit(KvCleared(self._next_seq()))

    def snapshot(self) -> KvSnapshot:
        """Every held block (parents before children), as of the last event."""
        # Most recent first puts each block's parent before it: parents are touched later.
        return KvSnapshot(tuple(reversed(self._blocks)), self._seq)

    def _touch(self, blocks: Sequence[int]) -> None:
        move = self._blocks.move_to_end
        for block in reversed(blocks):  # the first block ends up the most recent
            move(block)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _emit(self, event: KvEvent) -> None:
        if self.sink is not None:
            self.sink(event)

    def __repr__(self) -> str:
        return (
            f"PrefixCache(block_size={self.block_size}, {len(self._blocks)}/{self.capacity} "
            f"blocks, computed={self.computed_tokens}, cached={self.cached_tokens})"
        )
