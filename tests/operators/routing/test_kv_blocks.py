"""KV block ids: full blocks only, chained (one id names a prefix), the same in every
process, extensible from a parent or piece by piece, and what the KV router hashes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operators.contracts.llm import PreprocessedRequest
from operators.routing.kv_blocks import BlockHasher, block_hashes, request_block_ids
from pipeline.testing import make_context

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)
block_sizes = st.integers(1, 9)


def test_the_ids_are_pinned() -> None:
    """Routers and workers of different versions must agree: changing the hash means a
    new version in its personalization string, and new values here."""
    assert block_hashes(list(range(32)), 16) == [14118702527176720843, 1587689697811772876]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [13970238680189458237, 16834778025578591163]
    assert block_hashes([1, 2, 3, 4], 4, parent=7) == [11454826091304425739]


def test_the_ids_do_not_depend_on_the_processs_hash_seed() -> None:
    code = (
        "from operators.routing.kv_blocks import block_hashes; print(block_hashes(range(64), 16))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {f"{block_hashes(list(range(64)), 16)}\n"}


@given(tokens, block_sizes)
def test_only_full_blocks_get_ids_and_they_are_unsigned_64_bit(ids: list[int], size: int) -> None:
    hashes = block_hashes(ids, size)
    assert len(hashes) == len(ids) // size
    assert all(0 <= value < 2**64 for value in hashes)
    assert block_hashes(ids + [0] * (size - 1), size)[: len(hashes)] == hashes


@given(tokens, tokens, block_sizes)
def test_a_block_id_names_its_whole_prefix(first: list[int], second: list[int], size: int) -> None:
    """Two prompts share exactly the ids of the full blocks before they first differ."""
    a, b = block_hashes(first, size), block_hashes(second, size)
    common = next(
        (i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y),
        min(len(first), len(second)),
    )
    shared = common // size
    assert a[:shared] == b[:shared]
    assert all(x != y for x, y in zip(a[shared:], b[shared:], strict=False))


def test_changing_one_token_changes_its_block_and_every_later_one() -> None:
    prompt = list(range(64))
    changed = [*prompt[:20], 999, *prompt[21:]]
    before, after = block_hashes(prompt, 8), block_hashes(changed, 8)
    assert before[:2] == after[:2]
    assert all(x != y for x, y in zip(before[2:], after[2:], strict=True))


def test_block_sizes_never_share_ids() -> None:
    prompt = list(range(48))
    assert not set(block_hashes(prompt, 16)) & set(block_hashes(prompt, 8))
    assert not set(block_hashes(prompt, 16)) & set(block_hashes(prompt, 24))


@given(tokens, tokens, block_sizes)
def test_hashing_continues_from_a_parent(first: list[int], second: list[int], size: int) -> None:
    first = first[: len(first) // size * size]
    head = block_hashes(first, size)
    parent = head[-1] if head else None
    assert head + block_hashes(second, size, parent=parent) == block_hashes(first + second, size)


@given(tokens, block_sizes, st.lists(st.integers(0, 20), max_size=10))
def test_a_hasher_fed_piece_by_piece_gives_the_one_shot_ids(
    ids: list[int], size: int, cuts: list[int]
) -> None:
    hasher = BlockHasher(size)
    produced: list[int] = []
    rest = ids
    for cut in cuts:
        produced += hasher.extend(rest[:cut])
        rest = rest[cut:]
    produced += hasher.extend(rest)
    assert produced == block_hashes(ids, size)
    assert hasher.pending_tokens == len(ids) % size
    assert hasher.last_id == (produced[-1] if produced else None)
    assert hasher.block_size == size


def test_a_hasher_may_start_from_a_parent_and_keeps_nothing_of_a_bad_piece() -> None:
    parent = block_hashes([5] * 4, 4)[0]
    hasher = BlockHasher(4, parent=parent)
    assert hasher.last_id == parent
    assert hasher.extend([1, 2]) == []
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        hasher.extend([3, -1])
    assert hasher.pending_tokens == 2
    assert hasher.extend([3, 4]) == block_hashes([5] * 4 + [1, 2, 3, 4], 4)[1:]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: block_hashes([1], 0), "block_size"),
        (lambda: BlockHasher(-1), "block_size"),
        (lambda: block_hashes([1, 2**32], 2), r"\[0, 2\*\*32\)"),
        (lambda: block_hashes([-1], 1), r"\[0, 2\*\*32\)"),
        (lambda: block_hashes([1], 1, parent=2**64), "parent"),
        (lambda: block_hashes([1], 1, parent=-1), "parent"),
        (lambda: request_block_ids(0), "block_size"),
    ],
)
def test_bad_input_is_refused(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=message):
        call()


def test_request_block_ids_hashes_the_requests_token_ids() -> None:
    block_ids = request_block_ids(4)
    request = PreprocessedRequest(token_ids=list(range(10)), replayed_tokens=3)
    assert block_ids(make_context(request)) == block_hashes(list(range(10)), 4)
