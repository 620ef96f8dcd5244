"""KV cells that move: saved to the tiers before a slot overwrites them, restored from them,
and loaded after a transfer from a prefill worker. Used by the scheduler thread only.

Why save when a slot is about to be overwritten and not when its sequence finishes: a
finished sequence's cells stay in its slot as a prefix cache, and most are reused or
overwritten much later, if ever; saving only what is about to be lost costs one export
per overwrite instead of one per request. Blocks another slot still holds (a shared
system prompt) and blocks a tier holds already are not saved again.

Why whole blocks, named like the KV events: a tier is a store of the router's blocks, so
what a worker holds in RAM or on disk is visible to the KV router by the same ids, and a
restored prefix is exactly the cells a slot would hold after prefilling it. llama.cpp
loads a whole sequence at once (``llama_state_seq_set_data`` replaces it), so a restore
or a transfer exports the slot's own leading cells and loads them together with the new
ones: a copy in memory, a few milliseconds for a long prompt, against ~3 ms of prefill per
token.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, final

from operators.routing.kv_blocks import block_hashes

from ._kv_cells import KvCells

if TYPE_CHECKING:
    from pipeline import KvTier

    from ._kv_cells import KvLayout
    from ._runtime import Runtime
    from ._steps import Counters

__all__ = ("KvMover", "build_tiers")

logger = logging.getLogger("operators.engines.llama")


@final
class KvMover:
    """Moves KV cells between ``runtime``'s slots and ``tiers`` (the first is where
    evicted blocks go; it passes them further down itself, e.g. host to disk)."""

    __slots__ = ("_block_size", "_counters", "_runtime", "layout", "tiers")

    def __init__(
        self,
        runtime: Runtime,
        tiers: Sequence[KvTier],
        *,
        block_size: int,
        layout: KvLayout,
        counters: Counters,
    ) -> None:
        self._runtime = runtime
        self._block_size = block_size
        self._counters = counters
        self.tiers = list(tiers)
        #: the cells' layout on this model (what a transfer must match)
        self.layout = layout

    # ------------------------------------------------------------------------- tiers

    def save(self, slot: int, keep: int) -> None:
        """Save slot ``slot``'s full blocks from position ``keep`` on to the first tier
        (they are about to be cut or overwritten), except those still on the device in
        another slot or in a tier already."""
        tiers = self.tiers
        runtime = self._runtime
        if not tiers:
            return
        size = self._block_size
        tokens = runtime.cached[slot]
        full = len(tokens) // size
        first = keep // size
        if first >= full:
            return
        shared = max(
            (_common(tokens, other) for s, other in enumerate(runtime.cached) if s != slot),
            default=0,
        )
        first = max(first, shared // size)
        if first >= full:
            return
        ids = block_hashes(tokens[: full * size], size)
        todo = [j for j in range(first, full) if not any(ids[j] in tier for tier in tiers)]
        if not todo:
            return
        try:
            cells = runtime.export(slot)
        except Exception as exc:  # never lose a step over a cache
            logger.warning("KV blocks of slot %d not saved: %r", slot, exc)
            return
        top = tiers[0]
        saved = 0
        for j in todo:
            saved += top.put(ids[j], cells.slice(j * size, (j + 1) * size).payload())
        counters = self._counters
        counters.saved[top.name] = counters.saved.get(top.name, 0) + saved

    def restore(self, slot: int, prompt: Sequence[int], limit: int) -> int:
        """Extend slot ``slot``'s cells along ``prompt`` (up to ``limit`` tokens) with the
        consecutive blocks the tiers hold; the tokens restored."""
        tiers = self.tiers
        if not tiers or not any(len(tier) for tier in tiers):
            return 0
        runtime = self._runtime
        size = self._block_size
        have = len(runtime.cached[slot])
        first, last = have // size, limit // size
        if first >= last:
            return 0
        ids = block_hashes(prompt[: last * size], size)
        found: list[tuple[str, bytes]] = []
        for j in range(first, last):
            hit = next(
                ((tier.name, data) for tier in tiers if (data := tier.get(ids[j])) is not None),
                None,
            )
            if hit is None:
                break
            found.append(hit)
        if not found:
            return 0
        parts: list[KvCells] = []
        try:
            if first:
                parts.append(runtime.export(slot).slice(0, first * size))
            for i, (_, data) in enumerate(found):
                parts.append(KvCells.from_payload(self.layout, (first + i) * size, data))
            end = (first + len(found)) * size
            runtime.load(slot, KvCells.join(parts), prompt[:end])
        except Exception as exc:  # a block of another layout (KvFormatError), llama.cpp
            logger.warning("KV blocks not restored into slot %d: %r", slot, exc)
            runtime.keep(slot, min(have, len(runtime.cached[slot])))
            return 0
        counters = self._counters
        for i, (tier, _) in enumerate(found):
            counters.tier_hits[tier] = counters.tier_hits.get(tier, 0) + 1
            new = size - max(0, have - (first + i) * size)
            counters.restored[tier] = counters.restored.get(tier, 0) + new
        return end - have

    # ------------------------------------------------------------------------ slots

    def transplant(self, source: int, target: int, length: int) -> bool:
        """Copy slot ``source``'s first ``length`` cells into slot ``target`` at once;
        False when that failed (copy with ``Runtime.copy`` then).

        Why not ``Runtime.copy``: llama.cpp copies when the next step runs (and copies
        the whole stream), so a load into either slot before then would be overwritten.
        """
        runtime = self._runtime
        try:
            cells = runtime.export(source).slice(0, length)
            runtime.load(target, cells, runtime.cached[source][:length])
        except Exception as exc:  # never lose a request over a copy
            logger.warning("slot %d not copied into slot %d: %r", source, target, exc)
            return False
        return True

    # --------------------------------------------------------------------- transfers

    def receive(self, slot: int, cells: KvCells, tokens: Sequence[int]) -> None:
        """Make slot ``slot`` hold ``tokens``: its own leading cells up to ``cells.start``,
        then the transferred ``cells``.

        Raises:
            LlamaFailure: llama.cpp refused the cells (the slot is then empty).
            ValueError: the slot does not hold the cells before ``cells.start``.
        """
        runtime = self._runtime
        if len(runtime.cached[slot]) < cells.start or cells.end != len(tokens):
            raise ValueError(f"slot {slot} cannot take {cells!r} for {len(tokens)} tokens")
        parts = [cells]
        if cells.start:
            parts.insert(0, runtime.export(slot).slice(0, cells.start))
        runtime.load(slot, KvCells.join(parts), tokens)
        self._counters.transferred_tokens += cells.count
        self._counters.transferred_bytes += cells.nbytes


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def build_tiers(
    given: Sequence[KvTier],
    host_mb: int,
    disk: str | Path | None,
    disk_mb: int,
    model: Path,
    layout: KvLayout,
    block_size: int,
) -> list[KvTier]:
    """The engine's tiers: a host tier of ``host_mb`` MiB, then ``given``, then a disk tier
    in ``disk`` (named after the model, the layout and the block size: blocks of another
    model, layout or block size never meet), each evicting into the next."""
    from pipeline import DiskKvTier, MemoryKvTier

    tiers = list(given)
    if disk is not None:
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", model.stem)[:64]
        try:
            size = model.stat().st_size
        except OSError:
            size = 0
        identity = hashlib.blake2b(f"{model.name}:{size}".encode(), digest_size=4).hexdigest()
        namespace = f"{stem}-{identity}-{layout.fingerprint}-b{block_size}"
        tiers.append(DiskKvTier(disk, disk_mb << 20, namespace=namespace))
    if host_mb:
        below = tiers[0] if tiers else None
        tiers.insert(0, MemoryKvTier(host_mb << 20, below=below))
    return tiers
