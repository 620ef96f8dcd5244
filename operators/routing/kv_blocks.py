"""KV blocks: a prompt's token ids cut into fixed-size blocks, each named by a chained hash.

An engine that caches prompt prefixes reports what it holds as blocks (issue 16), and the
KV router (:class:`pipeline.kv_routing.KvRouter`) asks which worker holds the most leading
blocks of a request. Both sides must name a block the same way, in different processes on
different machines, so the id is a function of the tokens alone:

- only **full** blocks get ids (``len(token_ids) // block_size`` of them): a partial last
  block is not reusable as a prefix by any engine we route to;
- block ``i``'s id hashes block ``i - 1``'s id together with its own tokens, so **one id
  names the whole prefix** up to and including its block. Two prompts share block ``i``'s
  id only if they share their first ``(i + 1) * block_size`` tokens; the index then needs
  no tree, a flat map from id to holders is one.

The hash is BLAKE2b with an 8-byte digest (``hashlib``; no new dependency): the parent id
(8 bytes, little-endian; absent for the first block) then the block's ids as unsigned
32-bit little-endian integers, packed for the whole prompt with one ``array`` call. The
personalization string carries a version and the block size, so ids made with different
block sizes never meet. Why not the alternatives:

- Python's ``hash()`` of a tuple is not salted for ints, but it is CPython's private
  algorithm (it changed in 3.8) and platform-width: a router and a worker on different
  Pythons would disagree. xxhash would be faster but is not a dependency.
- A 32-bit checksum (``zlib.crc32``) collides within ~65k blocks (birthday bound); 64 bits
  puts the first collision near 4 billion blocks, and a collision only misroutes.
- **Adapters salt the chain**: the cells of a prompt run under an adapter (LoRA) hold other
  numbers than the base model's, so the first block of such a prompt hashes
  :func:`adapter_salt` (the adapter's name) as its parent. A prefix cached under one
  adapter is never reused, nor routed to, under another or the base model; base-model ids
  are unchanged.
- A fresh ``blake2b(..., digest_size=8)`` per block costs more than copying one prepared
  hasher (keyword parsing). Measured on the 2-core development machine for 16-token
  blocks (``benchmarks/bench_kv_index.py``, medians of two runs): 155-300 µs for a
  4096-token prompt's 256 ids (0.6-1.2 µs a block, ~55 µs of it packing the list of
  ints), 11-13 µs for a 128-token prompt. It runs once per request on the router, next
  to a tokenization that costs milliseconds for the same prompt.
"""

from __future__ import annotations

import array
import functools
import hashlib
import struct
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, final

if TYPE_CHECKING:
    from operators.contracts.llm import PreprocessedRequest
    from pipeline import Context

__all__ = ("BlockHasher", "adapter_salt", "block_hashes", "request_block_ids")

#: an array typecode for unsigned 32-bit ints (``I`` on every platform we know of)
_U32 = next(code for code in ("I", "L") if array.array(code).itemsize == 4)
_U64 = next(code for code in ("L", "Q") if array.array(code).itemsize == 8)
_BIG_ENDIAN = sys.byteorder == "big"
_VERSION = b"kv1"


@functools.lru_cache(maxsize=64)
def _hasher(block_size: int) -> Any:
    """A prepared BLAKE2b hasher for ``block_size``; each block hashes a copy of it."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    # 4 + 3 + 8 = 15 of the 16 bytes BLAKE2b allows
    return hashlib.blake2b(digest_size=8, person=b"llmp" + _VERSION + struct.pack("<Q", block_size))


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        packed = array.array(_U32, token_ids)
    except OverflowError:
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _parent_bytes(parent: int | None) -> bytes:
    if parent is None:
        return b""
    if not 0 <= parent < 1 << 64:
        raise ValueError(f"parent must be a block id in [0, 2**64), got {parent}")
    return parent.to_bytes(8, "little")


def _chain(packed: bytes, block_size: int, parent: bytes) -> tuple[list[int], bytes]:
    """Ids of the full blocks in ``packed`` after ``parent``, and the last id's bytes."""
    copy = _hasher(block_size).copy
    step = block_size * 4
    end = len(packed) // step * step
    digests: list[bytes] = []
    append = digests.append
    for start in range(0, end, step):
        hasher = copy()
        hasher.update(parent)
        hasher.update(packed[start : start + step])
        parent = hasher.digest()
        append(parent)
    ids = array.array(_U64, b"".join(digests))
    if _BIG_ENDIAN:
        ids.byteswap()
    return ids.tolist(), parent


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, parent: int | None = None
) -> list[int]:
    """The chained ids (unsigned 64-bit ints) of the full blocks of ``token_ids``.

    ``parent`` is the id of the block before ``token_ids[0]`` when they continue a prefix
    already hashed: ``block_hashes(a + b, n) == block_hashes(a, n) + block_hashes(b, n,
    parent=block_hashes(a, n)[-1])`` when ``len(a)`` is a multiple of ``n``. The same
    tokens give the same ids in every process.

    Raises:
        ValueError: a block size below 1, a token id outside ``[0, 2**32)`` or a parent
            outside ``[0, 2**64)``.
    """
    _hasher(block_size)  # validates block_size even for a prompt shorter than a block
    parent_bytes = _parent_bytes(parent)
    return _chain(_pack(token_ids), block_size, parent_bytes)[0]


@final
class BlockHasher:
    """Incremental :func:`block_hashes` for an engine that appends tokens as it goes.

    ``extend(tokens)`` returns the ids of the blocks those tokens complete; the tokens of
    an incomplete last block wait for the next call. Extending piece by piece gives the
    same ids as one :func:`block_hashes` over the concatenation, however it is cut.
    """

    __slots__ = ("_block_size", "_parent", "_pending")

    def __init__(self, block_size: int, *, parent: int | None = None) -> None:
        _hasher(block_size)
        self._block_size = block_size
        self._parent = _parent_bytes(parent)
        self._pending: list[int] = []

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def last_id(self) -> int | None:
        """The id of the last full block so far (the next block's parent), or None."""
        return int.from_bytes(self._parent, "little") if self._parent else None

    @property
    def pending_tokens(self) -> int:
        """Tokens received that do not fill a block yet."""
        return len(self._pending)

    def extend(self, token_ids: Sequence[int]) -> list[int]:
        """Append ``token_ids``; return the ids of the blocks they complete, in order.

        Raises:
            ValueError: a token id outside ``[0, 2**32)`` (nothing is appended then).
        """
        tokens = self._pending + list(token_ids) if self._pending else token_ids
        packed = _pack(tokens)  # validates every id before anything changes
        usable = len(tokens) // self._block_size * self._block_size
        if usable:
            ids, self._parent = _chain(packed, self._block_size, self._parent)
        else:
            ids = []
        self._pending = list(tokens[usable:])
        return ids


@functools.lru_cache(maxsize=256)
def adapter_salt(adapter: str | None) -> int | None:
    """The parent id of the first block of a prompt run under ``adapter`` (None: the base
    model's prompts have no salt)."""
    if adapter is None:
        return None
    digest = hashlib.blake2b(adapter.encode(), digest_size=8, person=b"llmp-lora").digest()
    return int.from_bytes(digest, "little")


def request_block_ids(block_size: int) -> Callable[[Context[PreprocessedRequest]], list[int]]:
    """The ``block_ids`` function a :class:`~pipeline.kv_routing.KvRouter` in front of
    LLM workers takes: the block ids of the request's ``token_ids`` (prompt, plus replayed
    output after a migration: the new worker's cache may hold those too), salted by its
    adapter (:func:`adapter_salt`).

    ``block_size`` must be the engines' (one size per worker pool).
    """
    _hasher(block_size)

    def block_ids(ctx: Context[PreprocessedRequest]) -> list[int]:
        request = ctx.data
        return block_hashes(request.token_ids, block_size, parent=adapter_salt(request.lora))

    return block_ids
