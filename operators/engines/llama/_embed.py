"""Embeddings from the generation model's own GGUF: :class:`Embeddings`, mean pooled.

A second llama.cpp context on the same file (memory-mapped, so the weights are shared by
the page cache), made with ``embeddings`` on, created on the first request for one. Each
input is a sequence; several are decoded together, each in its own KV stream
(``kv_unified`` off) and cleared after the batch.

Why the mean is taken here rather than by llama.cpp's ``pooling_type = MEAN``: llama.cpp
pools with one matrix product over every token of the micro-batch, so where an input sits
in the batch changes how its sum is grouped, and a vector would differ in its last bits
alone and batched. The tokens' own embeddings (the normed last hidden states, what
llama.cpp pools) do not depend on the batch (``GGML_LLAMAFILE=OFF``, one KV stream per
sequence: the same reasons as the engine's batch invariance), so their mean, summed in
float64 in token order, is the same vector alone or in any batch, and equals llama.cpp's
mean pooling up to float rounding. Vectors are not normalized (llama.cpp's pooled output
is not either); cosine similarity does not care.

:class:`Embedder` is the request tasks' side: it checks the inputs, creates the context on
the first call and runs one call at a time in a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, final

import anyio

from pipeline import EngineError, InvalidRequest

from ._runtime import LlamaFailure

try:
    import llama_cpp
    import numpy as np
except ImportError:  # the [llama] extra is missing: LlamaEngine() says so before any use
    pass

__all__ = ("EMBED_SEQUENCES", "Embedder", "Embeddings", "plan_batches")

#: inputs decoded together at most
EMBED_SEQUENCES: Final = 4


def plan_batches(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The inputs (by index, in order) grouped into decodes: at most
    :data:`EMBED_SEQUENCES` inputs and ``capacity`` tokens each (an input alone always
    fits: it holds at most ``capacity / EMBED_SEQUENCES`` tokens)."""
    groups: list[list[int]] = []
    tokens = 0
    for index, length in enumerate(lengths):
        if not groups or len(groups[-1]) == EMBED_SEQUENCES or tokens + length > capacity:
            groups.append([])
            tokens = 0
        groups[-1].append(index)
        tokens += length
    return groups


@final
class Embeddings:
    """Mean-pooled embeddings of the model at ``path``; inputs of at most ``n_ctx`` tokens.

    Blocking: call :meth:`embed` from one thread at a time (the engine holds a limiter).

    Raises:
        LlamaFailure: llama.cpp could not load the model or create the context.
    """

    def __init__(self, path: Path, *, n_ctx: int, n_threads: int) -> None:
        params = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise LlamaFailure(f"llama.cpp could not load {path} for embeddings")
        context = llama_cpp.llama_context_default_params()
        context.n_ctx = n_ctx * EMBED_SEQUENCES
        context.n_batch = context.n_ubatch = n_ctx * EMBED_SEQUENCES
        context.n_seq_max = EMBED_SEQUENCES
        context.kv_unified = False
        context.embeddings = True
        # (left unspecified: a chat model has no pooling of its own, so none is used)
        context.n_threads = context.n_threads_batch = n_threads
        context.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        context.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, context)
        if ctx and llama_cpp.llama_pooling_type(ctx) != llama_cpp.LLAMA_POOLING_TYPE_NONE:
            # an embedding model pools by itself: ask for the tokens' vectors instead
            llama_cpp.llama_free(ctx)
            context.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
            ctx = llama_cpp.llama_init_from_model(model, context)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise LlamaFailure(f"llama.cpp could not create an embedding context for {path}")
        self._model = model
        self._ctx: object | None = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self._lock = threading.Lock()
        #: tokens one input may hold
        self.n_ctx = n_ctx
        #: the vectors' length (576 for SmolLM2-135M)
        self.dimensions = int(llama_cpp.llama_model_n_embd(model))
        self._capacity = n_ctx * EMBED_SEQUENCES
        self._batch = llama_cpp.llama_batch_init(self._capacity, 0, 1)

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One mean-pooled vector per input (each 1..``n_ctx`` valid token ids).

        Raises:
            LlamaFailure: llama.cpp failed, or the context is closed.
        """
        vectors: list[list[float]] = [[] for _ in inputs]
        with self._lock:
            if self._ctx is None:
                raise LlamaFailure("the embedding context is closed")
            for group in plan_batches([len(tokens) for tokens in inputs], self._capacity):
                self._decode(inputs, group, vectors)
        return vectors

    def _decode(
        self, inputs: Sequence[Sequence[int]], group: list[int], vectors: list[list[float]]
    ) -> None:
        batch = self._batch
        n = 0
        for seq, index in enumerate(group):
            for position, token in enumerate(inputs[index]):
                batch.token[n] = token
                batch.pos[n] = position
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = 1
                n += 1
        batch.n_tokens = n
        llama_cpp.llama_memory_clear(self._memory, True)
        code = llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise LlamaFailure(f"llama_decode (embeddings) failed with code {code}")
        width = self.dimensions
        row = 0
        for index in group:
            total = np.zeros(width, dtype=np.float64)
            for _ in inputs[index]:
                pointer = llama_cpp.llama_get_embeddings_ith(self._ctx, row)
                if not pointer:
                    raise LlamaFailure(f"llama.cpp returned no embedding for batch index {row}")
                total += np.ctypeslib.as_array(pointer, shape=(width,))
                row += 1
            vectors[index] = (total / len(inputs[index])).astype(np.float32).tolist()
        llama_cpp.llama_memory_clear(self._memory, True)

    def close(self) -> None:
        """Free the context and the model's second mapping. Idempotent."""
        with self._lock:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                llama_cpp.llama_batch_free(self._batch)
                llama_cpp.llama_free(ctx)
                llama_cpp.llama_model_free(self._model)


@final
class Embedder:
    """The engine's embeddings, for its request tasks: inputs of at most ``limit`` tokens of
    a vocabulary of ``n_vocab``, embedded by an :class:`Embeddings` of the model at
    ``path`` created on the first call; ``closing`` says whether the engine is closing."""

    def __init__(
        self, path: Path, *, limit: int, n_vocab: int, n_threads: int, closing: Callable[[], bool]
    ) -> None:
        self._path = path
        self._limit = limit
        self._n_vocab = n_vocab
        self._n_threads = n_threads
        self._closing = closing
        self._embeddings: Embeddings | None = None  # created by the first embed()
        self._lock = anyio.Lock()

    async def embed(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """One vector per input (see :meth:`LlamaEngine.embed`).

        Raises:
            InvalidRequest: an empty input, one too long, ids outside the vocabulary;
                ``param`` is ``input.<i>`` (``input`` for a single one).
            EngineError: llama.cpp failed, or the engine is closed.
        """
        inputs = [list(tokens) for tokens in token_ids]
        for position, tokens in enumerate(inputs):
            param = f"input.{position}" if len(inputs) > 1 else "input"
            if not tokens:
                raise InvalidRequest("an input to embed is empty (no tokens)", param=param)
            if len(tokens) > self._limit:
                raise InvalidRequest(
                    f"an input to embed has {len(tokens)} tokens; at most {self._limit} are "
                    "allowed",
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
        async with self._lock:
            if self._closing():
                raise EngineError("the llama engine is closed")
            try:
                if self._embeddings is None:
                    self._embeddings = await anyio.to_thread.run_sync(
                        lambda: Embeddings(self._path, n_ctx=self._limit, n_threads=self._n_threads)
                    )
                return await anyio.to_thread.run_sync(self._embeddings.embed, inputs)
            except LlamaFailure as exc:
                raise EngineError(str(exc)) from exc

    def close(self) -> None:
        """Free the context, if one was created."""
        embeddings, self._embeddings = self._embeddings, None
        if embeddings is not None:
            embeddings.close()
