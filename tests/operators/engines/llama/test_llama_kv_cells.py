"""KV cells as bytes: llama.cpp's sequence state read, cut into blocks and written back.

Built on synthetic states (no model): a state with known bytes at every cell, layer and
embedding dimension, in both V layouts, must come back byte for byte through every path
the engine uses (slice, join, payload, state).
"""

from __future__ import annotations

import struct

import pytest

np = pytest.importorskip("numpy", reason="the llama engine's extra")

from operators.engines.llama._kv_cells import (  # noqa: E402
    STATE_MAGIC,
    KvCells,
    KvFormatError,
    KvLayout,
)

LAYERS, K_ROW, V_EL, EMBD = 3, 8, 2, 4


def state(start: int, count: int, *, v_trans: bool = True, n_stream: int = 2) -> bytes:
    """A state of ``count`` cells from position ``start`` in stream 0; every byte of cell
    ``p``'s K or V says which cell (``p``), layer and position in the row it is."""
    pieces = [struct.pack("<IiI", STATE_MAGIC, 0, n_stream), struct.pack("<I", count)]
    for position in range(start, start + count):
        pieces.append(struct.pack("<iIi", position, 1, 0))
    pieces.append(struct.pack("<II", int(v_trans), LAYERS))
    positions = np.arange(start, start + count, dtype=np.uint8)
    for layer in range(LAYERS):
        k = (positions[:, None] * 7 + layer * 31 + np.arange(K_ROW)) % 256
        pieces += [struct.pack("<iQ", 1, K_ROW), k.astype(np.uint8).tobytes()]
    for layer in range(LAYERS):
        if v_trans:
            v = positions[None, :, None] * 3 + layer * 17 + np.arange(EMBD)[:, None, None] * 5
            v = (v + np.arange(V_EL)[None, None, :]) % 256
            pieces += [struct.pack("<iII", 1, V_EL, EMBD), v.astype(np.uint8).tobytes()]
        else:
            v = (positions[:, None] * 3 + layer * 17 + np.arange(V_EL * EMBD)) % 256
            pieces += [struct.pack("<iQ", 1, V_EL * EMBD), v.astype(np.uint8).tobytes()]
    pieces.append(b"\0\0\0\0" * (n_stream - 1))
    return b"".join(pieces)


@pytest.mark.parametrize("v_trans", [True, False])
def test_a_state_comes_back_byte_for_byte(v_trans: bool) -> None:
    data = state(0, 10, v_trans=v_trans)
    cells = KvCells.from_state(data)
    assert (cells.start, cells.count, cells.layout.v_trans) == (0, 10, v_trans)
    assert cells.nbytes == 10 * cells.layout.cell_bytes == 10 * LAYERS * (K_ROW + V_EL * EMBD)
    assert cells.state(2) == data
    assert KvCells.from_state(cells.state(5)).payload() == cells.payload()  # more streams


@pytest.mark.parametrize("v_trans", [True, False])
def test_blocks_and_slices_join_into_the_cells_of_a_longer_run(v_trans: bool) -> None:
    whole = KvCells.from_state(state(0, 11, v_trans=v_trans))
    blocks = whole.blocks(4, 0, 2)  # positions 0..7, as a tier holds them
    parts = [KvCells.from_payload(whole.layout, 4 * i, block) for i, block in enumerate(blocks)]
    joined = KvCells.join([*parts, whole.slice(8, 11)])
    assert joined.payload() == whole.payload()
    assert joined.state(2) == state(0, 11, v_trans=v_trans)
    # what a decode worker pulls (from position 5) and loads after its own cells
    pulled = KvCells.from_payload(whole.layout, 5, whole.slice(5, 11).payload())
    assert KvCells.join([whole.slice(0, 5), pulled]).state(2) == state(0, 11, v_trans=v_trans)
    assert KvCells.from_state(state(3, 4, v_trans=v_trans)).payload() == whole.slice(3, 7).payload()


def test_the_layout_fingerprint_tells_models_apart() -> None:
    layout = KvCells.from_state(state(0, 2)).layout
    assert layout == KvCells.from_state(state(0, 5)).layout
    assert layout.fingerprint == KvCells.from_state(state(0, 5)).layout.fingerprint
    other = KvLayout(True, layout.k[:-1], layout.v[:-1])
    assert other.fingerprint != layout.fingerprint


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: b"\0\0\0\0" + data[4:], "magic"),
        (lambda data: data[:-9], "truncated|left"),
        (lambda data: data + b"\0", "left after"),
        (lambda data: data[:12] + b"\0\0\0\0" + b"\0\0\0\0", "empty"),
        (lambda data: data[:16] + struct.pack("<iIi", 0, 2, 0) + data[28:], "extras|shared"),
        (lambda data: data[:16] + struct.pack("<iIi", 5, 1, 0) + data[28:], "consecutive"),
    ],
)
def test_a_state_it_does_not_understand_is_refused(damage: object, message: str) -> None:
    with pytest.raises(KvFormatError, match=message):
        KvCells.from_state(damage(state(0, 3)))  # type: ignore[operator]


def test_misuse_is_refused() -> None:
    cells = KvCells.from_state(state(0, 4))
    with pytest.raises(KvFormatError, match="whole number"):
        KvCells.from_payload(cells.layout, 0, cells.payload()[:-1])
    with pytest.raises(ValueError, match="within"):
        cells.slice(2, 6)
    with pytest.raises(ValueError, match="consecutive"):
        KvCells.join([cells.slice(0, 2), cells.slice(3, 4)])
    with pytest.raises(ValueError, match="nothing"):
        KvCells.join([])
