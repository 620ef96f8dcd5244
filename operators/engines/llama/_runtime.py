"""One llama.cpp context with a KV sequence per slot: loading, batches, logits and KV cells.

llama.cpp is driven at the low level (our own ``llama_batch``, ``llama_decode``,
``llama_get_logits_ith``, ``llama_memory_seq_*``), so logits are read only for the positions
that need them and every step can mix tokens of several sequences.

Why a KV stream per slot (``kv_unified`` off) rather than one shared cache: in its own
stream a sequence's token at position i always sits in cell i, whatever the other slots
hold, so attention sums the same numbers in the same order whether the sequence runs alone
or beside seven others. In a unified cache the cells of concurrent sequences interleave and
the sums regroup, which breaks batch invariance. The costs, both taken into account by the
scheduler:

- a copy between slots (prefix reuse, the ``n`` choices of one request) copies the whole
  stream, a few ms for SmolLM2 at n_ctx 2048;
- llama.cpp puts only consecutive sequence ids into one micro-batch: feeds go in slot order,
  and new sequences take the lowest free slot.

Every method blocks and must be called from one thread at a time (the scheduler's), except
:meth:`Runtime.reading` and :meth:`Runtime.pieces`, which only read the vocabulary.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, final

from pipeline import EngineError

try:
    import llama_cpp
    import numpy as np
except ImportError:  # the [llama] extra is missing: LlamaEngine() says so before any use
    pass

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from ._kv_cells import KvCells
    from ._kv_events import KvLedger

    Row = NDArray[np.float32]

__all__ = ("Aborted", "Feed", "LlamaFailure", "Runtime")

_backend_ready = False


class Aborted(Exception):
    """A step was abandoned because its abort check fired (a request in it was stopped)."""


class LlamaFailure(RuntimeError):
    """llama.cpp reported an error (surfaces as :class:`pipeline.EngineError`)."""


class Feed(NamedTuple):
    """Tokens appended to one sequence by a step."""

    #: the sequence (slot) id
    seq: int
    tokens: Sequence[int]
    #: how many of the last tokens need logits (0 for a chunk inside a prompt)
    logits: int


@final
class Runtime:
    """A llama.cpp model and context with ``parallel`` KV sequences of ``n_ctx`` cells each.

    ``cached[s]`` mirrors sequence ``s``'s KV cells: the token at position i is
    ``cached[s][i]``. It survives the sequence that filled it, so a new prompt can reuse the
    longest common prefix.
    """

    def __init__(
        self, path: Path, *, n_ctx: int, n_threads: int, parallel: int, n_batch: int
    ) -> None:
        global _backend_ready
        if not _backend_ready:
            # llama-cpp-python's log callback prints whatever its logger lets through.
            quiet = logging.getLogger("llama-cpp-python")
            if quiet.level == logging.NOTSET:
                quiet.setLevel(logging.ERROR)
            llama_cpp.llama_backend_init()
            _backend_ready = True
        model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params()
        )
        if not model:
            raise EngineError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx * parallel
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = parallel
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = n_threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # see docs/llama.md
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise EngineError(f"llama.cpp could not create a context for {path}")
        self._model = model
        self._ctx: object | None = ctx
        # the vocabulary may be read from another thread (reading()): close() waits for it
        self._reading = threading.RLock()
        vocab = llama_cpp.llama_model_get_vocab(model)
        memory = llama_cpp.llama_get_memory(ctx)
        if memory is None or vocab is None:
            self.close()
            raise EngineError(f"{path}: llama.cpp found no KV memory or no vocabulary")
        self._memory = memory
        self._vocab = vocab
        self.parallel = parallel
        self.n_batch = n_batch
        self.n_ctx = int(llama_cpp.llama_n_ctx_seq(ctx))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.eog = frozenset(
            token for token in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, token)
        )
        self.cached: list[list[int]] = [[] for _ in range(parallel)]
        #: told where cells are cut, copied over or cleared (the KV events); extensions it
        #: sees in ``cached`` itself
        self.ledger: KvLedger | None = None
        # The batch lives in numpy arrays of our own, so a step fills it with slice
        # assignments; every token belongs to exactly one sequence.
        self._tokens = np.zeros(n_batch, dtype=np.int32)
        self._positions = np.zeros(n_batch, dtype=np.int32)
        self._n_seq_ids = np.ones(n_batch, dtype=np.int32)
        self._seq_ids = np.zeros(n_batch, dtype=np.int32)
        self._want_logits = np.zeros(n_batch, dtype=np.int8)
        int32_p = ctypes.POINTER(ctypes.c_int32)
        base = self._seq_ids.ctypes.data
        self._seq_id_rows = (int32_p * n_batch)(
            *(ctypes.cast(base + 4 * i, int32_p) for i in range(n_batch))
        )
        self._batch = llama_cpp.llama_batch(
            n_tokens=0,
            token=self._tokens.ctypes.data_as(int32_p),
            embd=None,
            pos=self._positions.ctypes.data_as(int32_p),
            n_seq_id=self._n_seq_ids.ctypes.data_as(int32_p),
            seq_id=ctypes.cast(self._seq_id_rows, ctypes.POINTER(int32_p)),
            logits=self._want_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self._abort: Callable[[], bool] | None = None
        self._abort_callback = llama_cpp.ggml_abort_callback(self._should_abort)
        #: graph nodes computed in the steps that poll ``abort`` (prompt chunks): progress
        #: within a step, which a long prompt's chunk may take seconds of
        self.polls = 0
        # A copy between streams is queued by llama.cpp until the next decode: reading or
        # loading a stream before that would see, or be overwritten by, stale buffers.
        self._copies_queued = False
        self._adapter: object | None = None  # the adapter decodes run with (None: none)

    def _should_abort(self, _data: object) -> bool:
        self.polls += 1
        abort = self._abort
        return abort is not None and abort()

    def decode(self, feeds: Sequence[Feed], abort: Callable[[], bool] | None = None) -> list[int]:
        """Append every feed's tokens to its sequence in one ``llama_decode``.

        Feeds must be in increasing sequence order and hold at most ``n_batch`` tokens in
        all. Returns the batch index of each feed's first token (for :meth:`row`).
        ``abort`` is polled by llama.cpp while it computes (between graph nodes): only
        steps that may be long (a prompt chunk) should pass it.

        Raises:
            Aborted: ``abort()`` returned True; every sequence is as before the call.
            LlamaFailure: llama.cpp failed; every sequence is as before the call.
        """
        n = 0
        offsets: list[int] = []
        want = self._want_logits
        for feed in feeds:
            size = len(feed.tokens)
            start = len(self.cached[feed.seq])
            end = n + size
            self._tokens[n:end] = feed.tokens
            self._positions[n:end] = np.arange(start, start + size, dtype=np.int32)
            self._seq_ids[n:end] = feed.seq
            want[n : end - feed.logits] = 0
            want[end - feed.logits : end] = 1
            offsets.append(n)
            n = end
        if n and not want[:n].any():
            want[n - 1] = 1  # llama.cpp expects at least one output per batch
        self._batch.n_tokens = n
        if abort is not None:
            self._abort = abort
            llama_cpp.llama_set_abort_callback(self._ctx, self._abort_callback, None)
        try:
            code = llama_cpp.llama_decode(self._ctx, self._batch)
        finally:
            if abort is not None:
                llama_cpp.llama_set_abort_callback(self._ctx, llama_cpp.ggml_abort_callback(), None)
                self._abort = None
        if code != 0:
            # Micro-batches computed before a failure or an abort stay in the cache.
            for feed in feeds:
                self._remove(feed.seq, len(self.cached[feed.seq]))
            if code == 2 and abort is not None:
                raise Aborted
            raise LlamaFailure(f"llama_decode failed with code {code}")
        self._copies_queued = False
        for feed in feeds:
            self.cached[feed.seq].extend(feed.tokens)
        return offsets

    def row(self, i: int) -> Row:
        """The logits at batch index ``i`` of the last decode (a view, valid until the next
        decode); ``i`` must be a position that asked for logits."""
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, i)
        if not pointer:
            raise LlamaFailure(f"llama.cpp returned no logits for batch index {i}")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def keep(self, seq: int, length: int) -> None:
        """Drop sequence ``seq``'s cells from position ``length`` on."""
        if length < len(self.cached[seq]):
            self._remove(seq, length)

    def copy(self, source: int, target: int) -> None:
        """Make sequence ``target`` a copy of ``source`` (in a split cache llama.cpp copies
        the whole stream before the next decode)."""
        if source != target:
            llama_cpp.llama_memory_seq_cp(self._memory, source, target, -1, -1)
            self._copies_queued = True
            self.cached[target] = list(self.cached[source])
            if self.ledger is not None:
                self.ledger.truncated(target, 0)

    # ------------------------------------------------------------- KV cells as bytes

    def export(self, seq: int) -> KvCells:
        """Sequence ``seq``'s cells (``len(cached[seq])`` of them, from position 0), copied
        out of llama.cpp (``llama_state_seq_get_data``).

        Raises:
            LlamaFailure: the sequence is empty, or llama.cpp failed.
            KvFormatError: its state is not one :class:`KvCells` understands.
        """
        from ._kv_cells import KvCells

        if not self.cached[seq]:
            raise LlamaFailure(f"sequence {seq} holds no cells to export")
        self._settle()
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq))
        buffer = bytearray(size)
        view = (ctypes.c_uint8 * size).from_buffer(buffer)
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, view, size, seq))
        del view  # the bytearray may not be resized while a ctypes view exports it
        if written != size:
            raise LlamaFailure(f"llama.cpp copied {written} of {size} bytes of sequence {seq}")
        cells = KvCells.from_state(buffer)
        if cells.start != 0 or cells.count != len(self.cached[seq]):
            raise LlamaFailure(
                f"sequence {seq} holds cells {cells.start}..{cells.end}, "
                f"expected 0..{len(self.cached[seq])}"
            )
        return cells

    def load(self, seq: int, cells: KvCells, tokens: Sequence[int]) -> None:
        """Make sequence ``seq`` hold ``cells`` (positions 0 on), the KV of ``tokens``
        (``llama_state_seq_set_data``): whatever it held is replaced.

        Raises:
            LlamaFailure: llama.cpp refused the cells (another model's, or too many); the
                sequence is then empty.
        """
        if cells.start != 0 or cells.count != len(tokens):
            raise ValueError(f"{cells!r} are not the KV of {len(tokens)} tokens from position 0")
        self._settle()
        if self.ledger is not None:
            self.ledger.truncated(seq, 0)
        state = cells.state(self.parallel)
        source = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        read = int(llama_cpp.llama_state_seq_set_data(self._ctx, source, len(state), seq))
        if read != len(state):
            llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self.cached[seq].clear()
            raise LlamaFailure(f"llama.cpp could not load {cells!r} into sequence {seq}")
        self.cached[seq] = list(tokens)

    def _settle(self) -> None:
        """Carry out copies llama.cpp queued (``copy``): a one-token decode runs its
        update, and the token is removed again."""
        if not self._copies_queued:
            return
        seq = next(s for s in range(self.parallel) if len(self.cached[s]) < self.n_ctx)
        length = len(self.cached[seq])
        self.decode([Feed(seq, [0], 0)])
        self._remove(seq, length)

    def clear(self) -> None:
        """Forget every sequence."""
        llama_cpp.llama_memory_clear(self._memory, True)
        for cached in self.cached:
            cached.clear()
        if self.ledger is not None:
            self.ledger.cleared()

    def _remove(self, seq: int, start: int) -> None:
        if self.ledger is not None:
            self.ledger.truncated(seq, start)
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq, start, -1):
            llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)  # whole: never fails
            self.cached[seq].clear()
            raise LlamaFailure(
                "this model's KV memory cannot drop the end of a sequence "
                "(a recurrent model?); the llama engine cannot run it"
            )
        del self.cached[seq][start:]

    def fill(self, seq: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq`` without logits, a batch at a time."""
        for start in range(0, len(tokens), self.n_batch):
            self.decode([Feed(seq, tokens[start : start + self.n_batch], 0)])

    # ------------------------------------------------------------------- adapters

    def load_adapter(self, path: str) -> object:
        """An adapter (LoRA) GGUF of this model, loaded (``llama_adapter_lora_init``).

        Raises:
            LlamaFailure: llama.cpp refused it (no adapter GGUF, another model's).
        """
        adapter = llama_cpp.llama_adapter_lora_init(self._model, path.encode())
        if not adapter:
            raise LlamaFailure(f"llama.cpp could not load {path} as an adapter of this model")
        return adapter

    def use_adapter(self, adapter: object | None) -> None:
        """Run the next decodes with ``adapter`` at scale 1 (None: the base model)."""
        if adapter is self._adapter:
            return
        if adapter is None:
            code = llama_cpp.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)  # type: ignore[misc]
            scales = (ctypes.c_float * 1)(1.0)
            code = llama_cpp.llama_set_adapters_lora(self._ctx, adapters, 1, scales)
        if code != 0:
            raise LlamaFailure(f"llama.cpp could not set the adapter (code {code})")
        self._adapter = adapter

    def free_adapter(self, adapter: object) -> None:
        """Free an adapter no sequence runs with any more (the base model runs next if it
        was in use)."""
        if adapter is self._adapter:
            self.use_adapter(None)
        if self._ctx is not None:
            llama_cpp.llama_adapter_lora_free(adapter)

    @contextlib.contextmanager
    def reading(self) -> Iterator[object]:
        """The vocabulary (a ``llama_vocab *``), kept alive until the block ends: another
        thread may read it meanwhile (tokenize, list pieces), and :meth:`close` waits.

        Raises:
            LlamaFailure: the model is closed.
        """
        with self._reading:
            if self._ctx is None:
                raise LlamaFailure("the model is closed")
            yield self._vocab

    def pieces(self) -> list[bytes]:
        """Every token's bytes, by id; those of control and end-of-generation tokens
        (``<|im_end|>``) start with 0xFF.

        What a token-mask library needs to know of the vocabulary: the bytes each token adds
        to the text, and which tokens are markers that no text may contain. User-defined
        tokens (a Hermes model's ``<tool_call>``) stay plain text, so a constraint's literal
        ``<tool_call>`` can be that one token. Any thread may call it (see :meth:`reading`).
        """
        buffer = ctypes.create_string_buffer(256)
        control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
        pieces: list[bytes] = []
        with self.reading() as vocab:
            for token in range(self.n_vocab):
                size = llama_cpp.llama_token_to_piece(vocab, token, buffer, 256, 0, True)
                if size < 0:
                    raise LlamaFailure(f"token {token} is longer than 256 bytes")
                piece = buffer.raw[:size]
                if token in self.eog or llama_cpp.llama_vocab_get_attr(vocab, token) & control:
                    piece = b"\xff" + piece
                pieces.append(piece)
        return pieces

    def close(self) -> None:
        """Free the context and the model. Idempotent."""
        with self._reading:
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(self._model)
