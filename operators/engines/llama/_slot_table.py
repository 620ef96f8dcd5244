"""The scheduler's slots: which sequence holds each one, whose cells each one keeps, and the
moves that place, free and compact them. Used by the scheduler thread only.

A slot's cells outlive its sequence, as a prefix cache for the next: a new sequence goes
to the free slot that holds most of its prompt (:func:`~._placement.choose_slot`), or gets
the prefix copied from a busy slot that holds much more. A slot's cells were computed
under one adapter (LoRA; ``_lora``), so only a sequence of that adapter reuses them.

KV that moves (``_kv_moves``): with tiers, a slot's blocks are saved before its cells are
overwritten and a new prompt's blocks restored from them when placed; a request that
continues a prefill worker's first token is placed, then waits (its slot reserved) while
its task pulls the cells the slot lacks, and joins the prefilling sequences when they have
arrived (or failed to: then its prompt is prefilled here).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, final

from ._placement import choose_slot, compaction
from ._runtime import LlamaFailure

if TYPE_CHECKING:
    from ._job import Job
    from ._kv_cells import KvCells
    from ._kv_moves import KvMover
    from ._lora import Adapter
    from ._runtime import Runtime
    from ._sequence import Choices, Sequence
    from ._steps import Counters

__all__ = ("SlotTable",)

logger = logging.getLogger("operators.engines.llama")

#: a decoding sequence is moved down into a free slot only if it has at least this many
#: tokens to go: the split batches it would cause must cost more than the move
_COMPACT_REMAINING: Final = 8


@final
class SlotTable:
    """``runtime``'s slots: :attr:`slots` (their sequences), :attr:`prefilling` (placed,
    prompt incomplete, oldest first) and the sequences waiting for pulled cells."""

    __slots__ = (
        "_awaiting",
        "_counters",
        "_owners",
        "_runtime",
        "gathered",
        "mover",
        "prefilling",
        "slots",
    )

    def __init__(self, runtime: Runtime, counters: Counters) -> None:
        self._runtime = runtime
        self._counters = counters
        self.slots: list[Sequence | None] = [None] * runtime.parallel
        self.prefilling: list[Sequence] = []
        self._awaiting: dict[Job, Sequence] = {}  # placed, waiting for pulled cells
        self._owners: list[Adapter | None] = [None] * runtime.parallel  # whose cells
        #: moves KV between slots, tiers and workers (None: it never moves)
        self.mover: KvMover | None = None
        #: this burst's prompts were gathered already (reset when every slot is free)
        self.gathered = False

    @property
    def running(self) -> int:
        """Sequences in a slot."""
        return sum(seq is not None for seq in self.slots)

    def admit(self, jobs: Iterable[tuple[Job, Choices]]) -> list[Job]:
        """Place queued choices in free slots, in arrival order: nobody overtakes. The jobs
        whose task now has something to do: pull the cells its slot lacks, or release
        the transfer it does not need."""
        told: list[Job] = []
        for job, choices in jobs:
            while choices.queued and len(choices.running) < job.width:
                free = [slot for slot, seq in enumerate(self.slots) if seq is None]
                if not free:
                    return told
                seq = choices.queued.popleft()
                leader = next((s for s in choices.running if s in self.prefilling), None)
                if leader is not None:
                    # A sibling is prefilling the same prompt: copy its cells when it is done.
                    seq.leader = leader
                    leader.followers.append(seq)
                    seq.slot = free[0]
                    self.slots[free[0]] = seq
                    self._own(free[0], job.adapter)
                    self._counters.cached += len(seq.prompt)
                elif self._place(seq, free):
                    told.append(job)
                choices.running.append(seq)
        return told

    def _place(self, seq: Sequence, free: list[int]) -> bool:
        """Put ``seq`` in the slot :func:`~._placement.choose_slot` picks, copying a donor's
        prefix there first if it picked one; with tiers, saving what the slot loses and
        restoring what they hold of the prompt; for a continuation, asking for the cells
        still missing. True when the job's task is to be told (see :meth:`admit`)."""
        runtime = self._runtime
        mover = self.mover
        job = seq.job
        adapter, owners = job.adapter, self._owners
        # only cells computed under the same adapter are a prefix of this prompt; on a tie,
        # a slot of its own adapter's or an empty one goes before one whose cells another
        # adapter could still reuse
        cached = [cells if owners[s] is adapter else () for s, cells in enumerate(runtime.cached)]
        free = sorted(free, key=lambda s: owners[s] is not adapter and bool(runtime.cached[s]))
        slot, reused, donor = choose_slot(cached, self.slots, free, seq.prompt)
        if mover is not None and owners[slot] is None:  # the tiers keep base-model blocks
            mover.save(slot, 0 if donor >= 0 else reused)
        self._own(slot, adapter)
        if donor >= 0:
            # With a mover, copied at once: no copy queued under a load to come.
            if mover is None or not mover.transplant(donor, slot, reused):
                runtime.copy(donor, slot)
        runtime.keep(slot, reused)
        if mover is not None and adapter is None:
            reused += mover.restore(slot, seq.prompt, len(seq.prompt) - 1)
        seq.slot = slot
        self.slots[slot] = seq
        self._counters.cached += reused
        if seq.index == 0 and not job.resumed:  # the request's cache hit (its siblings
            seq.cached = reused  # copy choice 0's prompt; a continuation's is reported)
        told = False
        if job.resumed and seq.index == 0:
            have = len(runtime.cached[slot])
            if job.transfer is None:
                self._counters.recomputed += 1
            elif have < seq.prompt_end:
                job.pull_from = have
                self._awaiting[job] = seq
                return True
            else:  # the slot holds the whole prompt already
                job.release_transfer = True
                told = True
        self.prefilling.append(seq)
        return told

    def arrived(self, job: Job, cells: KvCells | None) -> None:
        """``job``'s pulled cells are in (or not): load them, then prefill what is left."""
        seq = self._awaiting.pop(job, None)
        if seq is None or seq.slot is None:
            return  # retired meanwhile
        if cells is not None and self.mover is not None:
            try:
                self.mover.receive(seq.slot, cells, seq.prompt[: seq.prompt_end])
            except (LlamaFailure, ValueError) as exc:
                logger.warning("transferred KV cells not loaded: %s", exc)
                cells = None
        if cells is None:
            self._counters.recomputed += 1
        self.prefilling.append(seq)

    def vacate(self, seq: Sequence) -> None:
        """Free ``seq``'s slot. Its cells stay, as a prefix cache for the next sequence."""
        if seq.slot is not None and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        seq.slot = None
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if self._awaiting.get(seq.job) is seq:
            del self._awaiting[seq.job]
        if all(other is None for other in self.slots):
            # The burst is over, even if none of it ever decoded (one-token answers): the
            # next prompts that arrive together are gathered again.
            self.gathered = False

    def compact(self) -> None:
        """Move decoding sequences down into the free slots below them (see
        :func:`~._placement.compaction`)."""
        runtime = self._runtime
        while (move := compaction(self.slots, _COMPACT_REMAINING)) is not None:
            seq, source, target = move
            length = len(runtime.cached[source])
            self._own(target, self._owners[source])
            if self.mover is None or not self.mover.transplant(source, target, length):
                runtime.copy(source, target)
            self.slots[source], self.slots[target] = None, seq
            seq.slot = target
            self._counters.compactions += 1

    def forget(self, adapter: Adapter) -> None:
        """``adapter`` is being freed: the free slots holding its cells forget them (their
        blocks are reported removed)."""
        for slot, owner in enumerate(self._owners):
            if owner is adapter and self.slots[slot] is None:
                self._own(slot, None)

    def clear(self) -> None:
        """Forget every sequence (the scheduler stopped)."""
        self.slots = [None] * len(self.slots)
        self.prefilling.clear()
        self._awaiting.clear()

    def _own(self, slot: int, adapter: Adapter | None) -> None:
        """Slot ``slot``'s cells are (to be) computed under ``adapter``: another adapter's
        are cut first."""
        if self._owners[slot] is not adapter:
            self._runtime.keep(slot, 0)
        self._owners[slot] = adapter
        ledger = self._runtime.ledger
        if ledger is not None:
            ledger.salted(slot, None if adapter is None else adapter.salt)
