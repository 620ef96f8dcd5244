"""One step, carried out: the plan (``_plan``) over the slots, one ``llama_decode``, then
each fed sequence's output. Used by the scheduler thread only.

The decision is the plan's; this module reads the slots into it, runs what it says, keeps
its record (the step history, the counters, the pacer's measurements) and turns the rows of
logits into outputs, which it hands to the scheduler (``deliver``): the scheduler owns the
jobs and their outboxes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, NamedTuple, final

from ._pacing import Pacer
from ._plan import Occupant, Plan, plan_step

if TYPE_CHECKING:
    from operators.contracts.llm import EngineOutput

    from ._job import Job
    from ._lora import Adapter
    from ._runtime import Feed, Runtime
    from ._sequence import Sequence
    from ._slot_table import SlotTable
    from ._steps import Counters, LlamaStep

__all__ = ("Step", "Stepper")

#: steps kept for :meth:`Stepper.recent`
_HISTORY: Final = 1024

#: what receives a sequence's output (the scheduler's delivery to its job)
Deliver = Callable[["Sequence", "EngineOutput"], None]


class Step(NamedTuple):
    """A planned step and the sequences it feeds."""

    plan: Plan[Adapter | None]
    #: (sequence, its feed), in slot order
    work: list[tuple[Sequence, Feed]]
    #: (sequence, prompt tokens), oldest prompt first
    chunks: list[tuple[Sequence, int]]

    @property
    def jobs(self) -> list[Job]:
        """The jobs of the sequences fed (what fails if the step does)."""
        return list(dict.fromkeys(seq.job for seq, _ in self.work))


@final
class Stepper:
    """Plans and runs the steps over ``table``'s slots on ``runtime``."""

    __slots__ = (
        "_counters",
        "_last_ran",
        "_lock",
        "_pacer",
        "_runtime",
        "_step_tokens",
        "_steps",
        "_table",
    )

    def __init__(
        self,
        runtime: Runtime,
        table: SlotTable,
        counters: Counters,
        *,
        step_tokens: int,
        step_ms: float,
    ) -> None:
        self._runtime = runtime
        self._table = table
        self._counters = counters
        self._step_tokens = step_tokens
        self._pacer = Pacer(step_ms)
        self._last_ran: dict[Adapter | None, int] = {}  # the step each group last ran
        self._steps: deque[LlamaStep] = deque(maxlen=_HISTORY)
        self._lock = threading.Lock()  # the history is read from request tasks

    def recent(self) -> list[LlamaStep]:
        """The last steps, oldest first (at most 1024). Any thread may call it."""
        with self._lock:
            return list(self._steps)

    def forget(self, adapter: Adapter) -> None:
        """``adapter`` is freed: its turns are forgotten."""
        self._last_ran.pop(adapter, None)

    def plan(self) -> Step | None:
        """The next step over the slots as they are; None when no sequence can advance."""
        slots = self._table.slots
        plan = plan_step(
            [None if seq is None else self._occupant(seq) for seq in slots],
            [seq.slot for seq in self._table.prefilling if seq.slot is not None],
            last_ran=self._last_ran,
            step_tokens=self._step_tokens,
            idle_tokens=self._runtime.n_batch,
            prefill_budget=self._pacer.prefill_budget,
        )
        if plan is None:
            return None
        work = [(_in(slots, feed.seq), feed) for feed in plan.feeds]
        chunks = [(_in(slots, slot), size) for slot, size in plan.chunks]
        return Step(plan, work, chunks)

    def _occupant(self, seq: Sequence) -> Occupant[Adapter | None]:
        assert seq.slot is not None
        cached = len(self._runtime.cached[seq.slot])
        drafts: list[int] = []
        if seq.drafter is not None and seq.pending is not None and seq.behind <= 1:
            drafts = seq.propose(seq.room(self._runtime.n_ctx, cached))
        return Occupant(
            seq.job.adapter, seq.pending, seq.behind, cached, seq.prompt, seq.prompt_end, drafts
        )

    def run(self, step: Step, deliver: Deliver) -> None:
        """Decode ``step`` and hand each output to ``deliver``.

        Raises:
            Aborted: a request with a prompt chunk in the step was stopped meanwhile; every
                sequence is as before.
            LlamaFailure: llama.cpp failed (in the decode, or reading its logits).
        """
        runtime = self._runtime
        cached = runtime.cached
        group = step.plan.group
        stoppable = [seq.job for seq, _ in step.chunks]

        def stopped() -> bool:
            return any(job.cancelled or job.ctx.is_stopped for job in stoppable)

        self._last_ran[group] = self._counters.steps
        started = time.perf_counter()
        runtime.use_adapter(None if group is None else group.handle)
        offsets = runtime.decode([feed for _, feed in step.work], stopped if stoppable else None)
        self._record(
            step.plan.record._replace(
                seconds=time.perf_counter() - started,
                adapter=None if group is None else group.name,
            )
        )
        for seq, size in step.chunks:
            timeline = seq.job.timeline
            if timeline is not None:  # a traced request (prefill only: never per token)
                timeline.append(
                    ("prefill_chunk", time.time_ns(), {"llm_pipeline.prefill_tokens": size})
                )
        for (seq, feed), offset in zip(step.work, offsets, strict=True):
            if seq.pending is not None:
                self._decoded(seq, feed, offset, deliver)
            elif seq.slot is not None and len(cached[seq.slot]) == len(seq.prompt):
                self._prefilled(seq, offset + len(feed.tokens) - 1, deliver)

    def _record(self, step: LlamaStep) -> None:
        self._pacer.record(step)
        counters = self._counters
        counters.steps += 1
        counters.decode += step.decode_tokens
        counters.prefill += step.prefill_tokens
        counters.batch_sizes[step.batch_size] += 1
        with self._lock:
            self._steps.append(step)

    def _decoded(self, seq: Sequence, feed: Feed, offset: int, deliver: Deliver) -> None:
        runtime = self._runtime
        rows = [runtime.row(offset + i) for i in range(len(feed.tokens))]
        drafts = feed.tokens[1:]
        output, accepted = seq.emit(rows, drafts)
        if drafts and seq.slot is not None and seq.drafter is not None:
            # Keep the verified drafts in the KV cache; the last emitted token is pending.
            kept = len(runtime.cached[seq.slot]) - len(feed.tokens) + len(output.token_ids)
            runtime.keep(seq.slot, kept)
            seq.drafter.settle(len(drafts), accepted)
            self._counters.proposed += len(drafts)
            self._counters.accepted += accepted
        deliver(seq, output)

    def _prefilled(self, seq: Sequence, index: int, deliver: Deliver) -> None:
        """``seq``'s prompt is in: its first token, and its followers' (who copy its cells
        before its slot can be vacated)."""
        self._table.prefilling.remove(seq)
        timeline = seq.job.timeline
        if timeline is not None:
            timeline.append(("prefilled", time.time_ns(), {"llm_pipeline.slot": seq.slot or 0}))
        row = self._runtime.row(index)
        output, _ = seq.emit([row], ())
        followers, seq.followers = seq.followers, []
        outputs = [(seq, output)]
        for follower in followers:
            assert seq.slot is not None
            assert follower.slot is not None
            self._runtime.copy(seq.slot, follower.slot)
            follower.leader = None
            outputs.append((follower, follower.emit([row], ())[0]))
        for each, out in outputs:
            deliver(each, out)


def _in(slots: list[Sequence | None], slot: int) -> Sequence:
    seq = slots[slot]
    assert seq is not None
    return seq
