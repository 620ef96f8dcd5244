"""KV cells as bytes: a sequence's state from llama.cpp, cut into blocks and put back.

llama.cpp copies one sequence's KV cells out (``llama_state_seq_get_data``) and into
another sequence, context or process (``llama_state_seq_set_data``) with the same weights.
The state is all of the sequence's cells; to move only some of them (the blocks a decode
worker lacks, the blocks of a tier) the engine reads the format itself. For a split cache
(one stream per sequence) and a model without per-cell extras, a state is::

    u32 magic, i32 seq id, u32 n_stream, then per stream: u32 cell count, and if any:
      per cell: i32 position, u32 1, i32 seq id                     (the metadata)
      u32 v_trans, u32 n_layer
      per layer: i32 K type, u64 K row size, K rows (one per cell)
      per layer, V: i32 type, u64 row size, rows (not transposed), or
                    i32 type, u32 element size, u32 n_embd, then per embedding
                    dimension one element per cell (transposed)

:class:`KvCells` holds each layer's K and V of a run of consecutive positions as numpy
views of that buffer (no copy), slices and joins them along the cell axis, and writes them
back as a state (positions included) or as a *payload*: the K, then the V of every layer,
no headers, which is what a block of a tier and the transfer between workers carry. A
:class:`KvLayout` describes the sizes, so a payload is bytes and a layout's fingerprint.

Anything this module does not understand (another memory type, cells with extras,
unequal positions) is a :class:`KvFormatError`; the engine then does not move KV at all
(it says so at start-up) and recomputes instead.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

try:
    import numpy as np
except ImportError:  # the [llama] extra is missing: LlamaEngine() says so before any use
    pass

if TYPE_CHECKING:
    from numpy.typing import NDArray

    Bytes = NDArray[np.uint8]

__all__ = ("KvCells", "KvFormatError", "KvLayout")

#: llama.cpp's sequence state magic (``llama-context.cpp``)
STATE_MAGIC: Final = 0xAF143CD8
_CELL: Final = struct.Struct("<iIi")  # position, number of seq ids (1), seq id
_U32: Final = struct.Struct("<I")
_KHEAD: Final = struct.Struct("<iQ")  # type, row size
_VHEAD_TRANS: Final = struct.Struct("<iII")  # type, element size, n_embd


class KvFormatError(ValueError):
    """A sequence state this module cannot cut into cells."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The shape of one cell's KV: per layer, K (type, row bytes) and V (type, element or
    row bytes, embedding size when transposed)."""

    v_trans: bool
    #: per layer: (K type, K row bytes)
    k: tuple[tuple[int, int], ...]
    #: per layer: (V type, element bytes, n_embd) when transposed, else (type, row bytes, 0)
    v: tuple[tuple[int, int, int], ...]

    @property
    def cell_bytes(self) -> int:
        """Bytes of one cell in a payload."""
        k = sum(row for _, row in self.k)
        if self.v_trans:
            return k + sum(size * embd for _, size, embd in self.v)
        return k + sum(row for _, row, _ in self.v)

    @property
    def fingerprint(self) -> str:
        """A short name of the layout: workers exchange cells only when theirs match."""
        text = repr((self.v_trans, self.k, self.v)).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()


@final
class KvCells:
    """The KV of positions ``start .. start + count - 1`` of one sequence, by layer."""

    __slots__ = ("count", "k", "layout", "start", "v")

    def __init__(
        self, layout: KvLayout, start: int, count: int, k: list[Bytes], v: list[Bytes]
    ) -> None:
        self.layout = layout
        self.start = start
        self.count = count
        #: per layer: (count, K row bytes)
        self.k = k
        #: per layer: (n_embd, count, element bytes) when transposed, else (count, row bytes)
        self.v = v

    @property
    def end(self) -> int:
        """The position after the last cell."""
        return self.start + self.count

    @property
    def nbytes(self) -> int:
        """Bytes of the payload."""
        return self.count * self.layout.cell_bytes

    # ---------------------------------------------------------------------- the state

    @classmethod
    def from_state(cls, data: bytes | bytearray | memoryview) -> KvCells:
        """The cells of a state ``llama_state_seq_get_data`` wrote (views of ``data``).

        Raises:
            KvFormatError: not a single-sequence state of consecutive positions, or one
                with cell extras.
        """
        buffer = memoryview(data)
        size = len(buffer)
        try:
            magic, _seq, n_stream = struct.unpack_from("<IiI", buffer, 0)
            if magic != STATE_MAGIC:
                raise KvFormatError(f"not a llama.cpp sequence state (magic {magic:#x})")
            at = 12
            found: KvCells | None = None
            for _ in range(n_stream):
                (count,) = _U32.unpack_from(buffer, at)
                at += 4
                if not count:
                    continue
                if found is not None:
                    raise KvFormatError("cells in more than one stream")
                found, at = cls._parse_stream(buffer, at, count)
        except KvFormatError:
            raise
        except (struct.error, ValueError) as exc:  # numpy: "buffer is smaller than requested"
            raise KvFormatError(f"truncated state: {exc}") from None
        if at != size:
            raise KvFormatError(f"{size - at} bytes left after the state")
        if found is None:
            raise KvFormatError("an empty state: the sequence holds no cells")
        return found

    @classmethod
    def _parse_stream(cls, buffer: memoryview, at: int, count: int) -> tuple[KvCells, int]:
        meta = np.frombuffer(
            buffer,
            dtype=np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")]),
            count=count,
            offset=at,
        )
        start = int(meta["pos"][0])
        if not (meta["n"] == 1).all():
            raise KvFormatError("cells with extras, or shared by several sequences")
        if not np.array_equal(meta["pos"], np.arange(start, start + count, dtype=np.int32)):
            raise KvFormatError("the cells' positions are not consecutive")
        at += _CELL.size * count
        v_trans, n_layer = struct.unpack_from("<II", buffer, at)
        at += 8
        k_shapes: list[tuple[int, int]] = []
        ks: list[Bytes] = []
        for _ in range(n_layer):
            kind, row = _KHEAD.unpack_from(buffer, at)
            at += _KHEAD.size
            ks.append(np.frombuffer(buffer, np.uint8, count * row, at).reshape(count, row))
            at += count * row
            k_shapes.append((kind, row))
        v_shapes: list[tuple[int, int, int]] = []
        vs: list[Bytes] = []
        for _ in range(n_layer):
            array: Bytes
            if v_trans:
                kind, element, embd = _VHEAD_TRANS.unpack_from(buffer, at)
                at += _VHEAD_TRANS.size
                length = embd * count * element
                array = np.frombuffer(buffer, np.uint8, length, at).reshape(embd, count, element)
                v_shapes.append((kind, element, embd))
            else:
                kind, row = _KHEAD.unpack_from(buffer, at)
                at += _KHEAD.size
                length = count * row
                array = np.frombuffer(buffer, np.uint8, length, at).reshape(count, row)
                v_shapes.append((kind, row, 0))
            vs.append(array)
            at += length
        layout = KvLayout(bool(v_trans), tuple(k_shapes), tuple(v_shapes))
        return cls(layout, start, count, ks, vs), at

    def state(self, n_stream: int) -> bytes:
        """A state ``llama_state_seq_set_data`` loads into any sequence of a context with
        ``n_stream`` streams: these cells at their positions (a set replaces the target's)."""
        layout = self.layout
        count = self.count
        meta = np.zeros(count, dtype=np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")]))
        meta["pos"] = np.arange(self.start, self.end, dtype=np.int32)
        meta["n"] = 1
        pieces: list[bytes | memoryview] = [
            struct.pack("<IiII", STATE_MAGIC, 0, n_stream, count),
            meta.tobytes(),
            struct.pack("<II", int(layout.v_trans), len(self.k)),
        ]
        for (kind, row), k in zip(layout.k, self.k, strict=True):
            pieces += [_KHEAD.pack(kind, row), _contiguous(k)]
        for (kind, size, embd), v in zip(layout.v, self.v, strict=True):
            if layout.v_trans:
                pieces += [_VHEAD_TRANS.pack(kind, size, embd), _contiguous(v)]
            else:
                pieces += [_KHEAD.pack(kind, size), _contiguous(v)]
        pieces.append(b"\0\0\0\0" * (n_stream - 1))  # the other streams: no cells
        return b"".join(pieces)

    # ------------------------------------------------------------- slices and payloads

    def slice(self, start: int, end: int) -> KvCells:
        """Positions ``start .. end - 1`` (views, no copy)."""
        if not self.start <= start <= end <= self.end:
            raise ValueError(f"positions {start}..{end} are not within {self.start}..{self.end}")
        a, b = start - self.start, end - self.start
        ks = [k[a:b] for k in self.k]
        vs = [v[:, a:b] if self.layout.v_trans else v[a:b] for v in self.v]
        return KvCells(self.layout, start, end - start, ks, vs)

    @classmethod
    def join(cls, parts: Sequence[KvCells]) -> KvCells:
        """Consecutive runs of cells as one (their positions must follow each other)."""
        if not parts:
            raise ValueError("nothing to join")
        first = parts[0]
        for before, after in itertools.pairwise(parts):
            if after.start != before.end or after.layout != first.layout:
                raise ValueError("cells to join must be consecutive and of one layout")
        if len(parts) == 1:
            return first
        axis = 1 if first.layout.v_trans else 0
        n_layer = len(first.k)
        ks = [np.concatenate([part.k[i] for part in parts]) for i in range(n_layer)]
        vs = [np.concatenate([part.v[i] for part in parts], axis=axis) for i in range(n_layer)]
        return cls(first.layout, first.start, sum(part.count for part in parts), ks, vs)

    def payload(self) -> bytes:
        """The cells' bytes without headers: every layer's K, then every layer's V."""
        return b"".join(_contiguous(array) for array in (*self.k, *self.v))

    @classmethod
    def from_payload(cls, layout: KvLayout, start: int, data: bytes | bytearray) -> KvCells:
        """The cells :meth:`payload` wrote (views of ``data``) at positions from ``start``.

        Raises:
            KvFormatError: ``data`` is not a whole number of ``layout``'s cells.
        """
        cell = layout.cell_bytes
        count, left = divmod(len(data), cell)
        if left or not count:
            raise KvFormatError(f"{len(data)} bytes are not a whole number of {cell}-byte cells")
        at = 0
        ks: list[Bytes] = []
        for _, row in layout.k:
            ks.append(np.frombuffer(data, np.uint8, count * row, at).reshape(count, row))
            at += count * row
        vs: list[Bytes] = []
        for _, size, embd in layout.v:
            if layout.v_trans:
                length = embd * count * size
                vs.append(np.frombuffer(data, np.uint8, length, at).reshape(embd, count, size))
            else:
                length = count * size
                vs.append(np.frombuffer(data, np.uint8, length, at).reshape(count, size))
            at += length
        return cls(layout, start, count, ks, vs)

    def blocks(self, block_size: int, first: int, last: int) -> list[bytes]:
        """The payloads of blocks ``first .. last - 1`` (block i: positions ``i *
        block_size`` up to the next block)."""
        return [
            self.slice(i * block_size, (i + 1) * block_size).payload() for i in range(first, last)
        ]

    def __repr__(self) -> str:
        return f"KvCells({self.start}..{self.end}, {self.nbytes} bytes)"


def _contiguous(array: Bytes) -> memoryview:
    """The array's bytes in C order (a view when it is contiguous already)."""
    return memoryview(np.ascontiguousarray(array).data).cast("B")
