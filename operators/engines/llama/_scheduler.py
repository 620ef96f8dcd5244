"""The scheduler: one thread that runs every step of every sequence (continuous batching).

::

    request task (event loop)               scheduler thread
    -------------------------               -----------------------------------------------
    generate(ctx)
      FIFO admission: `width` slots
      submit(job) ------ inbox ----------->  receive   the job's choices join its queue
                                             retire    cancelled or stopped jobs free slots
                                             admit     place choices in free slots, reusing
                                                       the longest cached prefix
                                             plan      one adapter's sequences (LoRA; the
                                                       groups take turns), at most
                                                       `step_tokens` tokens:
                                                       1. the pending token of every decoding
                                                          sequence whose consumer keeps up
                                                       2. prompt chunks, oldest first
                                                       3. drafts, with what is left
                                             decode    one llama_decode (abortable if it
                                                       holds prompt chunks)
      take() / wait() <- outbox, doorbell -  emit      sample per sequence; free finished slots

Why one thread owns everything: llama.cpp's context is not thread-safe, and a step is the
unit of work. Every decision (placement, step contents, freeing) is made between steps, so
the request tasks only ever queue a job, take outputs and set a flag.

Why chunked prefill: a step costs about its token count on a CPU, so a long prompt fed in
one step would freeze every running sequence for its whole prefill. With a budget per step,
running sequences get a token every step and the prompt advances by what is left.

KV that moves (``_kv_moves``): with tiers, a slot's blocks are saved before its cells are
overwritten and a new prompt's blocks restored from them when placed; a request that
continues a prefill worker's first token is placed, then waits (its slot reserved) while
its task pulls the cells the slot lacks, and joins the prefilling sequences when they have
arrived (or failed to: then its prompt is prefilled here). On a prefill worker, a
sequence's cells are exported for a decode worker when its one token is out (``issuer``).

Adapters (``_lora``): llama.cpp applies them per context, so a step runs the sequences of
one adapter (or of the base model), the groups with work taking turns; a slot's cells are
reused only by a sequence of the adapter that computed them. Loading and freeing adapters
runs in this thread too (:meth:`Scheduler.call`, :meth:`Scheduler.retire`), between steps.

Why a sequence may run at most two outputs ahead of its consumer: the engine stays nearly
pull-driven (a slow client does not make the engine generate its whole answer into a
buffer, and a closed stream wastes at most two tokens), yet a consumer that keeps up never
makes its sequence miss a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Final, final

from operators.contracts.llm import EngineOutput
from operators.engines.ngram import NgramSpeculation
from pipeline import EngineError, InvalidRequest

from ._job import Job
from ._kv_events import KvReporter
from ._kv_moves import KvMover
from ._lora import Adapter, next_group
from ._pacing import Pacer
from ._placement import choose_slot, compaction
from ._runtime import Aborted, Feed, LlamaFailure, Runtime
from ._sequence import Sequence
from ._steps import Counters, LlamaStep

if TYPE_CHECKING:
    from ._kv_cells import KvCells

#: what a prefill worker's scheduler calls when a sequence's one token is out: the
#: transfer handle of its cells, for that output's ``prefill_result``
Issuer = Callable[[Job, Sequence, int], dict[str, Any]]

__all__ = ("Scheduler",)

logger = logging.getLogger("operators.engines.llama")

#: steps kept for :meth:`Scheduler.recent_steps`
_HISTORY: Final = 1024
#: a burst of prompts is gathered while they come within this many seconds of each other,
#: for at most the second
_GATHER: Final = 0.004
_GATHER_MAX: Final = 0.02
#: a decoding sequence is moved down into a free slot only if it has at least this many
#: tokens to go: the split batches it would cause must cost more than the move
_COMPACT_REMAINING: Final = 8


@final
class Scheduler:
    """Runs the steps of every sequence on ``runtime`` in a thread of its own.

    Request tasks call :meth:`submit`, :meth:`nudge` and read :attr:`counters`,
    :attr:`running`, :attr:`queued` and :meth:`recent_steps`; everything else runs in the
    scheduler's thread.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        step_tokens: int,
        speculation: NgramSpeculation | None,
        kv: KvReporter | None = None,
        check_kv: bool = False,
        step_ms: float = 0.0,
    ) -> None:
        self._runtime = runtime
        self._check_kv = check_kv
        self._pacer = Pacer(step_ms)
        self._kv = kv
        self._step_tokens = step_tokens
        self._speculation = speculation
        self._slots: list[Sequence | None] = [None] * runtime.parallel
        self._prefilling: list[Sequence] = []  # placed, prompt incomplete; oldest first
        self._jobs: list[Job] = []  # received and not done; oldest first
        self._inbox: deque[Job] = deque()
        self._lock = threading.Lock()  # submit vs. shutdown; the step history
        self._wake = threading.Event()
        self._stopping = False
        self._stopped = False
        self._steps: deque[LlamaStep] = deque(maxlen=_HISTORY)
        self._unrung: dict[Job, None] = {}  # jobs with outputs their task was not told of
        self.counters = Counters(runtime.parallel)
        #: moves KV between slots, tiers and workers (None: it never moves)
        self.mover: KvMover | None = None
        #: issues a prefill worker's transfer handles (None: not a prefill worker)
        self.issuer: Issuer | None = None
        self._awaiting: dict[Job, Sequence] = {}  # placed, waiting for pulled cells
        self._arrivals: deque[tuple[Job, KvCells | None]] = deque()
        self._probed = threading.Event()
        self._probe: bool | Exception = False
        self._gathered = False  # this burst's prompts were gathered already
        self._owners: list[Adapter | None] = [None] * runtime.parallel  # whose cells
        self._last_ran: dict[Adapter | None, int] = {}  # the step each group last ran
        self._calls: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._retiring: list[Adapter] = []  # unloaded; freed once no job runs with them
        #: whether KV cells survive an export and a load (checked when asked at start)
        self.kv_portable = False
        self._thread = threading.Thread(target=self._run, name="llama-scheduler", daemon=True)
        self._thread.start()

    def batch_invariant(self) -> bool:
        """The result of :meth:`Runtime.batch_invariant`, run in the scheduler's thread
        before its first step (blocks until then).

        Why there: ggml's CPU backend keeps a team of OpenMP threads per calling thread, and
        a team left behind by another thread made every later decode ~60 % slower.

        Raises:
            EngineError: llama.cpp failed on the probe.
        """
        self._probed.wait()
        if isinstance(self._probe, Exception):
            raise EngineError(f"llama.cpp failed: {self._probe}") from self._probe
        return self._probe

    # ------------------------------------------------------------ from request tasks

    def arrive(self, job: Job, cells: KvCells | None) -> None:
        """The cells ``job`` pulled (None: the pull failed, prefill instead)."""
        self._arrivals.append((job, cells))
        self._wake.set()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (its request already holds ``job.width`` free slots).

        Raises:
            EngineError: the scheduler has stopped.
        """
        with self._lock:
            if self._stopped:
                raise EngineError("the llama engine is closed", request_id=job.ctx.id)
            self._inbox.append(job)
        self._wake.set()

    def call(self, work: Callable[[], object]) -> Future[object]:
        """Run ``work`` in the scheduler's thread between two steps (loading an adapter:
        llama.cpp's model and context are this thread's); its result or exception in the
        future.

        Raises:
            EngineError: the scheduler has stopped.
        """
        future: Future[object] = Future()
        with self._lock:
            if self._stopped:
                raise EngineError("the llama engine is closed")
            self._calls.append((work, future))
        self._wake.set()
        return future

    def retire(self, adapter: Adapter) -> None:
        """Free ``adapter`` once no request runs with it (a request still waiting to
        start with it then fails: 400 naming ``model``)."""
        self.call(lambda: self._retiring.append(adapter))

    def nudge(self) -> None:
        """Wake the scheduler: an output was taken, or a job was cancelled."""
        self._wake.set()

    @property
    def running(self) -> int:
        """Sequences in a slot."""
        return sum(seq is not None for seq in self._slots)

    @property
    def queued(self) -> int:
        """Choices received but not in a slot yet (those of ``n`` above the width)."""
        return sum(len(job.queued) for job in list(self._jobs)) + sum(
            job.n for job in list(self._inbox)
        )

    def recent_steps(self) -> list[LlamaStep]:
        """The last steps, oldest first (at most 1024)."""
        with self._lock:
            return list(self._steps)

    def stop(self) -> None:
        """Stop the thread after its current step; requests still running get an
        EngineError. Blocks until the thread has ended."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    # ----------------------------------------------------------- the scheduler thread

    def _run(self) -> None:
        message = "the llama engine is closed"
        try:
            self._probe = self._runtime.batch_invariant()
            if self._check_kv:
                self.kv_portable = self._runtime.kv_portable()
        except LlamaFailure as exc:
            self._probe = exc
            self._stopping = True
        finally:
            self._probed.set()
        try:
            while not self._stopping:
                self._wake.clear()
                self._receive()
                self._run_calls()
                self._retire()
                self._free_adapters()
                self._admit()
                self._gather()
                self._compact()
                stepped = self._step()
                self._report_kv()
                if not stepped:
                    self._ring()
                    self._wake.wait()
        except Exception as exc:  # a bug: fail every request rather than leave it hanging
            logger.exception("the llama scheduler failed")
            message = f"the llama engine failed: {exc!r}"
        finally:
            with self._lock:
                self._stopped = True
                self._receive()
            self._ring()
            for job in self._jobs:
                job.end(EngineError(message, request_id=job.ctx.id))
            self._jobs.clear()
            while self._calls:
                self._calls.popleft()[1].set_exception(EngineError(message))
            self._slots = [None] * len(self._slots)
            self._prefilling.clear()
            self._awaiting.clear()

    def _receive(self) -> None:
        runtime = self._runtime
        counters = self.counters
        while self._inbox:
            job = self._inbox.popleft()
            if job.adapter is not None and job.adapter.freed:
                name = job.adapter.name
                error = InvalidRequest(
                    f"the adapter {name!r} was unloaded", param="model", request_id=job.ctx.id
                )
                job.end(error)
                continue
            self._jobs.append(job)
            job.queued.extend(
                Sequence(
                    job, i, eog=runtime.eog, n_vocab=runtime.n_vocab, speculation=self._speculation
                )
                for i in range(job.n)
            )
            counters.requests += 1
            counters.prompt += len(job.request.token_ids) - job.resumed
        while self._arrivals:
            job, cells = self._arrivals.popleft()
            self._arrived(job, cells)

    def _arrived(self, job: Job, cells: KvCells | None) -> None:
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
            self.counters.recomputed += 1
        self._prefilling.append(seq)

    def _run_calls(self) -> None:
        while self._calls:
            work, future = self._calls.popleft()
            try:
                result = work()
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _free_adapters(self) -> None:
        """Free the unloaded adapters no job runs with; the free slots holding their cells
        forget them (their blocks are reported removed)."""
        for adapter in list(self._retiring):
            if any(job.adapter is adapter for job in self._jobs):
                continue
            for slot, owner in enumerate(self._owners):
                if owner is adapter and self._slots[slot] is None:
                    self._own(slot, None)
            self._runtime.free_adapter(adapter.handle)
            adapter.freed = True
            self._last_ran.pop(adapter, None)
            self._retiring.remove(adapter)

    def _own(self, slot: int, adapter: Adapter | None) -> None:
        """Slot ``slot``'s cells are (to be) computed under ``adapter``: another adapter's
        are cut first."""
        if self._owners[slot] is not adapter:
            self._runtime.keep(slot, 0)
        self._owners[slot] = adapter
        ledger = self._runtime.ledger
        if ledger is not None:
            ledger.salted(slot, None if adapter is None else adapter.salt)

    def _retire(self) -> None:
        """Cancelled jobs and stopped requests leave their slots."""
        for job in [job for job in self._jobs if job.cancelled or job.ctx.is_stopped]:
            for seq in job.running:
                self._vacate(seq)
            job.running.clear()
            job.queued.clear()
            self._jobs.remove(job)
            if job.cancelled:
                job.drop()
            else:  # ctx.stop_generating(): the stream ends, with no finish reason
                job.end()

    def _admit(self) -> None:
        """Place queued choices in free slots, in arrival order: nobody overtakes."""
        for job in self._jobs:
            while job.queued and len(job.running) < job.width:
                free = [slot for slot, seq in enumerate(self._slots) if seq is None]
                if not free:
                    return
                seq = job.queued.popleft()
                leader = next((s for s in job.running if s in self._prefilling), None)
                if leader is not None:
                    # A sibling is prefilling the same prompt: copy its cells when it is done.
                    seq.leader = leader
                    leader.followers.append(seq)
                    seq.slot = free[0]
                    self._slots[free[0]] = seq
                    self._own(free[0], job.adapter)
                    self.counters.cached += len(seq.prompt)
                else:
                    self._place(seq, free)
                job.running.append(seq)

    def _place(self, seq: Sequence, free: list[int]) -> None:
        """Put ``seq`` in the slot :func:`~._placement.choose_slot` picks, copying a donor's
        prefix there first if it picked one; with tiers, saving what the slot loses and
        restoring what they hold of the prompt; for a continuation, asking for the cells
        still missing."""
        runtime = self._runtime
        mover = self.mover
        job = seq.job
        adapter, owners = job.adapter, self._owners
        # only cells computed under the same adapter are a prefix of this prompt; on a tie,
        # a slot of its own adapter's or an empty one goes before one whose cells another
        # adapter could still reuse
        cached = [cells if owners[s] is adapter else () for s, cells in enumerate(runtime.cached)]
        free = sorted(free, key=lambda s: owners[s] is not adapter and bool(runtime.cached[s]))
        slot, reused, donor = choose_slot(cached, self._slots, free, seq.prompt)
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
        self._slots[slot] = seq
        self.counters.cached += reused
        if seq.index == 0 and not job.resumed:  # the request's cache hit (its siblings
            seq.cached = reused  # copy choice 0's prompt; a continuation's is reported)
        if job.resumed and seq.index == 0:
            have = len(runtime.cached[slot])
            if job.transfer is None:
                self.counters.recomputed += 1
            elif have < seq.prompt_end:
                job.pull_from = have
                self._awaiting[job] = seq
                self._unrung[job] = None
                return
            else:  # the slot holds the whole prompt already
                job.release_transfer = True
                self._unrung[job] = None
        self._prefilling.append(seq)

    def _vacate(self, seq: Sequence) -> None:
        """Free ``seq``'s slot. Its cells stay, as a prefix cache for the next sequence."""
        if seq.slot is not None and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
        seq.slot = None
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        if self._awaiting.get(seq.job) is seq:
            del self._awaiting[seq.job]
        if all(other is None for other in self._slots):
            # The burst is over, even if none of it ever decoded (one-token answers): the
            # next prompts that arrive together are gathered again.
            self._gathered = False

    def _gather(self) -> None:
        """Before the first step of a burst that only prefills, wait a moment for more
        prompts (at most 20 ms, while they keep coming within 4 ms of each other).

        Why: requests that arrive together (a closed loop's clients, whose previous answers
        ended in one step) are then prefilled in one step and answer in step; admitted a
        few ms apart, each later prompt's prefill would stall the answers already started,
        once per request, for as long as a prompt takes.
        """
        slots = self._slots
        if any(seq is not None and seq.pending is not None for seq in slots):
            self._gathered = False  # a new burst may come once these are done
            return
        if self._gathered or not self._prefilling or None not in slots:
            return
        self._gathered = True
        deadline = time.perf_counter() + _GATHER_MAX
        while time.perf_counter() < deadline:
            if not self._wake.wait(_GATHER) or self._stopping:
                return
            # Cleared before the inbox is read, never after: a prompt submitted in between
            # would otherwise leave no wake-up behind and wait out the window unseen.
            self._wake.clear()
            self._receive()
            self._retire()
            self._admit()
            if None not in slots:
                return

    def _compact(self) -> None:
        """Move decoding sequences down into the free slots below them (see
        :func:`~._placement.compaction`)."""
        runtime = self._runtime
        while (move := compaction(self._slots, _COMPACT_REMAINING)) is not None:
            seq, source, target = move
            length = len(runtime.cached[source])
            self._own(target, self._owners[source])
            if self.mover is None or not self.mover.transplant(source, target, length):
                runtime.copy(source, target)
            self._slots[source], self._slots[target] = None, seq
            seq.slot = target
            self.counters.compactions += 1

    def _step(self) -> bool:
        """Plan and run one step; False when there is nothing to do."""
        runtime = self._runtime
        cached = runtime.cached
        decoding = [
            seq
            for seq in self._slots
            if seq is not None and seq.pending is not None and seq.behind <= 1
        ]  # in slot order; a sequence whose consumer is two outputs behind waits
        prefilling = self._prefilling
        groups = dict.fromkeys(seq.job.adapter for seq in (*decoding, *prefilling))
        group = next_group(groups, self._last_ran)
        if len(groups) > 1:  # llama.cpp runs one adapter per step: the groups take turns
            decoding = [seq for seq in decoding if seq.job.adapter is group]
            prefilling = [seq for seq in prefilling if seq.job.adapter is group]
        # While nobody waits for a token, a step takes as much prompt as the batch holds.
        waiting = any(seq is not None and seq.pending is not None for seq in self._slots)
        budget = (self._step_tokens if waiting else runtime.n_batch) - len(decoding)
        prompt_budget = self._pacer.prefill_budget(len(decoding), budget)
        chunks: list[tuple[Sequence, int]] = []
        for seq in prefilling:
            if prompt_budget <= 0:
                break
            assert seq.slot is not None
            size = min(len(seq.prompt) - len(cached[seq.slot]), prompt_budget)
            chunks.append((seq, size))
            budget -= size
            prompt_budget -= size
        if not decoding and not chunks:
            return False
        work: list[tuple[Sequence, Feed]] = []
        for seq in decoding:
            assert seq.slot is not None
            assert seq.pending is not None
            drafts: list[int] = []
            if seq.drafter is not None and budget > 0:
                drafts = seq.propose(min(budget, seq.room(runtime.n_ctx, len(cached[seq.slot]))))
                budget -= len(drafts)
            work.append((seq, Feed(seq.slot, [seq.pending, *drafts], 1 + len(drafts))))
        for seq, size in chunks:
            assert seq.slot is not None
            start = len(cached[seq.slot])
            end = start + size
            work.append((seq, Feed(seq.slot, seq.prompt[start:end], int(end == len(seq.prompt)))))
        work.sort(key=lambda item: item[1].seq)
        # A continuation's last "prompt" token is the prefill worker's output: decoded here.
        prompt_tokens = sum(
            max(0, min(size, seq.prompt_end - len(cached[seq.slot])))
            for seq, size in chunks
            if seq.slot is not None
        )
        record = LlamaStep(
            decoded=tuple(seq.slot for seq in decoding if seq.slot is not None),
            drafted=tuple(
                feed.seq for seq, feed in work if seq.pending is not None and feed.logits > 1
            ),
            decode_tokens=sum(len(feed.tokens) for seq, feed in work if seq.pending is not None)
            + sum(size for _, size in chunks)
            - prompt_tokens,
            prefilled=tuple(seq.slot for seq, _ in chunks if seq.slot is not None),
            prefill_tokens=prompt_tokens,
            seconds=0.0,
            adapter=None if group is None else group.name,
        )
        stoppable = [seq.job for seq, _ in chunks]

        def stopped() -> bool:
            return any(job.cancelled or job.ctx.is_stopped for job in stoppable)

        self._ring()
        self._last_ran[group] = self.counters.steps
        started = time.perf_counter()
        try:
            runtime.use_adapter(None if group is None else group.handle)
            offsets = runtime.decode([feed for _, feed in work], stopped if stoppable else None)
        except Aborted:
            return True  # the next pass retires the stopped request; the rest run again
        except LlamaFailure as exc:
            self._fail([seq.job for seq, _ in work], exc)
            return True
        self._record(record._replace(seconds=time.perf_counter() - started))
        for seq, size in chunks:
            timeline = seq.job.timeline
            if timeline is not None:  # a traced request (prefill only: never per token)
                timeline.append(
                    ("prefill_chunk", time.time_ns(), {"llm_pipeline.prefill_tokens": size})
                )
        try:
            for (seq, feed), offset in zip(work, offsets, strict=True):
                if seq.pending is not None:
                    self._decoded(seq, feed, offset)
                elif seq.slot is not None and len(cached[seq.slot]) == len(seq.prompt):
                    self._prefilled(seq, offset + len(feed.tokens) - 1)
        except LlamaFailure as exc:
            self._fail([seq.job for seq, _ in work], exc)
        return True

    def _ring(self) -> None:
        """Wake the tasks of the jobs with new outputs. Deferred until the next step is
        planned, just before llama_decode lets go of the GIL: a task woken earlier would
        compete for the GIL with the scheduler's own Python work (measured: a 64-token
        answer alone at 68 instead of ~95 tokens/s)."""
        for job in self._unrung:
            job.ring()
        self._unrung.clear()

    def _record(self, step: LlamaStep) -> None:
        self._pacer.record(step)
        counters = self.counters
        counters.steps += 1
        counters.decode += step.decode_tokens
        counters.prefill += step.prefill_tokens
        counters.batch_sizes[step.batch_size] += 1
        with self._lock:
            self._steps.append(step)

    def _decoded(self, seq: Sequence, feed: Feed, offset: int) -> None:
        runtime = self._runtime
        rows = [runtime.row(offset + i) for i in range(len(feed.tokens))]
        drafts = feed.tokens[1:]
        output, accepted = seq.emit(rows, drafts)
        if drafts and seq.slot is not None and seq.drafter is not None:
            # Keep the verified drafts in the KV cache; the last emitted token is pending.
            kept = len(runtime.cached[seq.slot]) - len(feed.tokens) + len(output.token_ids)
            runtime.keep(seq.slot, kept)
            seq.drafter.settle(len(drafts), accepted)
            self.counters.proposed += len(drafts)
            self.counters.accepted += accepted
        self._deliver(seq, output)

    def _prefilled(self, seq: Sequence, index: int) -> None:
        """``seq``'s prompt is in: its first token, and its followers' (who copy its cells
        before its slot can be vacated)."""
        self._prefilling.remove(seq)
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
            self._deliver(each, out)

    def _deliver(self, seq: Sequence, output: EngineOutput) -> None:
        job = seq.job
        issuer = self.issuer
        if issuer is not None and output.finish_reason == "length" and job.n == 1:
            output.prefill_result = issuer(job, seq, output.token_ids[-1])
        seq.produced += 1
        self.counters.generated += len(output.token_ids)
        job.push(output)
        self._unrung[job] = None
        if output.finish_reason is not None:
            self._vacate(seq)
            job.running.remove(seq)
            job.finished += 1
            if job.finished == job.n:
                self._jobs.remove(job)
                self._report_kv()  # before the task sees its end: its blocks are reported
                job.end()

    def _report_kv(self) -> None:
        """Queue the KV events of what changed in the slots' cells (nothing to do, and no
        hashing, while nobody listens)."""
        kv = self._kv
        if kv is not None and kv.sink is not None:
            kv.sync(self._runtime.cached)

    def _fail(self, jobs: list[Job], exc: Exception) -> None:
        """llama.cpp failed in a step: its requests get an EngineError."""
        logger.warning("llama.cpp failed: %s", exc)
        for job in dict.fromkeys(jobs):
            if job not in self._jobs:
                continue
            for seq in job.running:
                self._vacate(seq)
            job.running.clear()
            job.queued.clear()
            self._jobs.remove(job)
            job.end(EngineError(f"llama.cpp failed: {exc}", request_id=job.ctx.id))
