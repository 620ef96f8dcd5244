"""The scheduler: one thread that runs every step of every sequence (continuous batching).

::

    request task (event loop)               scheduler thread
    -------------------------               -----------------------------------------------
    generate(ctx)
      admission: `width` slots
      submit(job) ------ inbox ----------->  receive   the job's choices join its queue
                                             retire    cancelled or stopped jobs free slots
                                             admit     place choices in free slots, reusing
                                                       the longest cached prefix
                                                       (``_slot_table``)
                                             plan      one adapter's sequences (LoRA; the
                                                       groups take turns), at most
                                                       `step_tokens` tokens (``_plan``):
                                                       1. the pending token of every decoding
                                                          sequence whose consumer keeps up
                                                       2. prompt chunks, oldest first
                                                       3. drafts, with what is left
                                             decode    one llama_decode (abortable if it
                                                       holds prompt chunks; ``_stepper``)
      take() / wait() <- outbox, doorbell -  emit      sample per sequence; free finished slots

Why one thread owns everything: llama.cpp's context is not thread-safe, and a step is the
unit of work. Every decision (placement, step contents, freeing) is made between steps, so
the request tasks only ever queue a job, take outputs and set a flag. Loading and freeing
adapters (LoRA) runs in this thread too (:meth:`Scheduler.call`, :meth:`Scheduler.retire`),
between steps. On a prefill worker, a sequence's cells are exported for a decode worker
when its one token is out (``issuer``).

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
from pipeline import EngineDead, EngineError, InvalidRequest

from ._job import Job
from ._kv_events import KvReporter
from ._probes import batch_invariant, kv_layout
from ._runtime import Aborted, LlamaFailure, Runtime
from ._sequence import Choices, Sequence
from ._slot_table import SlotTable
from ._stepper import Stepper
from ._steps import Counters, LlamaStep

if TYPE_CHECKING:
    from ._kv_cells import KvCells, KvLayout
    from ._kv_moves import KvMover
    from ._lora import Adapter

#: what a prefill worker's scheduler calls when a sequence's one token is out: the
#: transfer handle of its cells, for that output's ``prefill_result``
Issuer = Callable[[Job, Sequence, int], dict[str, Any]]

__all__ = ("Issuer", "Scheduler")

logger = logging.getLogger("operators.engines.llama")

#: a burst of prompts is gathered while they come within this many seconds of each other,
#: for at most the second
_GATHER: Final = 0.004
_GATHER_MAX: Final = 0.02


@final
class Scheduler:
    """Runs the steps of every sequence on ``runtime`` in a thread of its own.

    Request tasks call :meth:`submit`, :meth:`arrive`, :meth:`call`, :meth:`retire`,
    :meth:`nudge` and read :attr:`counters`, :attr:`running`, :attr:`queued` and
    :meth:`recent_steps`; everything else runs in the scheduler's thread.
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
        self._kv = kv
        self._speculation = speculation
        self.counters = Counters(runtime.parallel)
        self._table = SlotTable(runtime, self.counters)
        self._stepper = Stepper(
            runtime, self._table, self.counters, step_tokens=step_tokens, step_ms=step_ms
        )
        self._jobs: dict[Job, Choices] = {}  # received and not done; oldest first
        self._inbox: deque[Job] = deque()
        self._lock = threading.Lock()  # submit and call vs. shutdown
        self._wake = threading.Event()
        self._stopping = False
        self._stopped = False
        #: why the thread died, if it raised (its requests and later ones get EngineDead)
        self.failure: str | None = None
        self._unrung: dict[Job, None] = {}  # jobs with outputs their task was not told of
        #: issues a prefill worker's transfer handles (None: not a prefill worker)
        self.issuer: Issuer | None = None
        self._arrivals: deque[tuple[Job, KvCells | None]] = deque()
        self._probed = threading.Event()
        self._probe: bool | Exception = False
        self._calls: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._retiring: list[Adapter] = []  # unloaded; freed once no job runs with them
        #: the layout of the model's KV cells if they survive an export and a load
        #: (probed at start when asked; None: they cannot move)
        self.kv_layout: KvLayout | None = None
        self._thread = threading.Thread(target=self._run, name="llama-scheduler", daemon=True)
        self._thread.start()

    def move_kv(self, mover: KvMover) -> None:
        """Move KV between slots, tiers and workers with ``mover`` (by default it never
        moves); called once, before the first request."""
        self._table.mover = mover

    def batch_invariant(self) -> bool:
        """The result of :func:`~._probes.batch_invariant`, run in the scheduler's thread
        before its first step (blocks until then; :attr:`kv_layout` is known then too).

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
                raise self._gone(job.ctx.id)
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
                raise self._gone(None)
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
        return self._table.running

    @property
    def queued(self) -> int:
        """Choices received but not in a slot yet (those of ``n`` above the width)."""
        return sum(len(choices.queued) for choices in list(self._jobs.values())) + sum(
            job.n for job in list(self._inbox)
        )

    def recent_steps(self) -> list[LlamaStep]:
        """The last steps, oldest first (at most 1024)."""
        return self._stepper.recent()

    def _gone(self, request_id: str | None) -> EngineError | EngineDead:
        """What a request gets once the thread has ended: EngineDead if it died (the
        engine's health rebuilds the engine), EngineError if it was closed."""
        if self.failure is not None:
            return EngineDead(self.failure, request_id=request_id)
        return EngineError("the llama engine is closed", request_id=request_id)

    def stop(self) -> None:
        """Stop the thread after its current step; requests still running get an
        EngineError. Blocks until the thread has ended."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    # ----------------------------------------------------------- the scheduler thread

    def _run(self) -> None:
        try:
            self._probe = batch_invariant(self._runtime)
            if self._check_kv:
                self.kv_layout = kv_layout(self._runtime)
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
                self._table.compact()
                stepped = self._step()
                self._report_kv()
                if not stepped:
                    self._ring()
                    self._wake.wait()
        except Exception as exc:  # a bug: fail every request rather than leave it hanging
            logger.exception("the llama scheduler failed")
            self.failure = f"its scheduler thread raised {exc!r}"
        finally:
            with self._lock:
                self._stopped = True
                self._receive()
            self._ring()
            for job in self._jobs:
                job.end(self._gone(job.ctx.id))
            self._jobs.clear()
            while self._calls:
                self._calls.popleft()[1].set_exception(self._gone(None))
            self._table.clear()

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
            self._jobs[job] = Choices(
                Sequence(
                    job, i, eog=runtime.eog, n_vocab=runtime.n_vocab, speculation=self._speculation
                )
                for i in range(job.n)
            )
            counters.requests += 1
            counters.prompt += len(job.request.token_ids) - job.resumed
        while self._arrivals:
            self._table.arrived(*self._arrivals.popleft())

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
            self._table.forget(adapter)
            self._runtime.free_adapter(adapter.handle)
            adapter.freed = True
            self._stepper.forget(adapter)
            self._retiring.remove(adapter)

    def _retire(self) -> None:
        """Cancelled jobs and stopped requests leave their slots."""
        for job in [job for job in self._jobs if job.cancelled or job.ctx.is_stopped]:
            self._leave(job)
            if job.cancelled:
                job.drop()
            else:  # ctx.stop_generating(): the stream ends, with no finish reason
                job.end()

    def _leave(self, job: Job) -> None:
        """``job`` leaves the scheduler: its sequences free their slots."""
        choices = self._jobs.pop(job)
        for seq in choices.running:
            self._table.vacate(seq)
        choices.clear()

    def _admit(self) -> None:
        for job in self._table.admit(self._jobs.items()):
            self._unrung[job] = None

    def _gather(self) -> None:
        """Before the first step of a burst that only prefills, wait a moment for more
        prompts (at most 20 ms, while they keep coming within 4 ms of each other).

        Why: requests that arrive together (a closed loop's clients, whose previous answers
        ended in one step) are then prefilled in one step and answer in step; admitted a
        few ms apart, each later prompt's prefill would stall the answers already started,
        once per request, for as long as a prompt takes.
        """
        table = self._table
        slots = table.slots
        if any(seq is not None and seq.pending is not None for seq in slots):
            table.gathered = False  # a new burst may come once these are done
            return
        if table.gathered or not table.prefilling or None not in slots:
            return
        table.gathered = True
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

    def _step(self) -> bool:
        """Plan and run one step; False when there is nothing to do."""
        step = self._stepper.plan()
        if step is None:
            return False
        self._ring()
        try:
            self._stepper.run(step, self._deliver)
        except Aborted:
            pass  # the next pass retires the stopped request; the rest run again
        except LlamaFailure as exc:
            self._fail(step.jobs, exc)
        return True

    def _ring(self) -> None:
        """Wake the tasks of the jobs with new outputs. Deferred until the next step is
        planned, just before llama_decode lets go of the GIL: a task woken earlier would
        compete for the GIL with the scheduler's own Python work (measured: a 64-token
        answer alone at 68 instead of ~95 tokens/s)."""
        for job in self._unrung:
            job.ring()
        self._unrung.clear()

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
            self._table.vacate(seq)
            choices = self._jobs[job]
            choices.running.remove(seq)
            choices.finished += 1
            if choices.finished == job.n:
                del self._jobs[job]
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
        for job in jobs:
            if job not in self._jobs:
                continue
            self._leave(job)
            job.end(EngineError(f"llama.cpp failed: {exc}", request_id=job.ctx.id))
