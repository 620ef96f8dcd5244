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
                                             plan      at most `step_tokens` tokens:
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
from typing import Final, final

from operators.contracts.llm import EngineOutput
from operators.engines.ngram import NgramSpeculation
from pipeline import EngineError

from ._job import Job
from ._kv_events import KvReporter
from ._placement import choose_slot
from ._runtime import Aborted, Feed, LlamaFailure, Runtime
from ._sequence import Sequence
from ._steps import Counters, LlamaStep

__all__ = ("Scheduler",)

logger = logging.getLogger("operators.engines.llama")

#: steps kept for :meth:`Scheduler.recent_steps`
_HISTORY: Final = 1024


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
    ) -> None:
        self._runtime = runtime
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
        self._probed = threading.Event()
        self._probe: bool | Exception = False
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
        except LlamaFailure as exc:
            self._probe = exc
            self._stopping = True
        finally:
            self._probed.set()
        try:
            while not self._stopping:
                self._wake.clear()
                self._receive()
                self._retire()
                self._admit()
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
            self._slots = [None] * len(self._slots)
            self._prefilling.clear()

    def _receive(self) -> None:
        runtime = self._runtime
        counters = self.counters
        while self._inbox:
            job = self._inbox.popleft()
            self._jobs.append(job)
            job.queued.extend(
                Sequence(
                    job, i, eog=runtime.eog, n_vocab=runtime.n_vocab, speculation=self._speculation
                )
                for i in range(job.n)
            )
            counters.requests += 1
            counters.prompt += len(job.request.token_ids)

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
                    self.counters.cached += len(seq.prompt)
                else:
                    self._place(seq, free)
                job.running.append(seq)

    def _place(self, seq: Sequence, free: list[int]) -> None:
        """Put ``seq`` in the slot :func:`~._placement.choose_slot` picks, copying a donor's
        prefix there first if it picked one."""
        runtime = self._runtime
        slot, reused, donor = choose_slot(runtime.cached, self._slots, free, seq.prompt)
        if donor >= 0:
            runtime.copy(donor, slot)
        runtime.keep(slot, reused)
        seq.slot = slot
        self._slots[slot] = seq
        self._prefilling.append(seq)
        self.counters.cached += reused
        if seq.index == 0:  # the request's cache hit (its siblings copy choice 0's prompt)
            seq.cached = reused

    def _vacate(self, seq: Sequence) -> None:
        """Free ``seq``'s slot. Its cells stay, as a prefix cache for the next sequence."""
        if seq.slot is not None and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
        seq.slot = None
        if seq in self._prefilling:
            self._prefilling.remove(seq)

    def _step(self) -> bool:
        """Plan and run one step; False when there is nothing to do."""
        runtime = self._runtime
        cached = runtime.cached
        budget = self._step_tokens
        decoding = [
            seq
            for seq in self._slots
            if seq is not None and seq.pending is not None and seq.behind <= 1
        ]  # in slot order; a sequence whose consumer is two outputs behind waits
        budget -= len(decoding)
        chunks: list[tuple[Sequence, int]] = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            assert seq.slot is not None
            size = min(len(seq.prompt) - len(cached[seq.slot]), budget)
            chunks.append((seq, size))
            budget -= size
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
        record = LlamaStep(
            decoded=tuple(seq.slot for seq in decoding if seq.slot is not None),
            drafted=tuple(
                feed.seq for seq, feed in work if seq.pending is not None and feed.logits > 1
            ),
            decode_tokens=sum(len(feed.tokens) for seq, feed in work if seq.pending is not None),
            prefilled=tuple(seq.slot for seq, _ in chunks if seq.slot is not None),
            prefill_tokens=sum(size for _, size in chunks),
            seconds=0.0,
        )
        stoppable = [seq.job for seq, _ in chunks]

        def stopped() -> bool:
            return any(job.cancelled or job.ctx.is_stopped for job in stoppable)

        self._ring()
        started = time.perf_counter()
        try:
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
