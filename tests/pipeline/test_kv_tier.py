"""KV tiers: host memory and disk stores of KV blocks, bounded by size, reporting events.

A tier must give back exactly the bytes it was given, or nothing: a corrupt or truncated
disk file is deleted and reported removed, never returned.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import DiskKvTier, KvEvent, KvRemoved, KvStored, KvTier, MemoryKvTier


class Events(list[KvEvent]):
    def __call__(self, event: KvEvent) -> None:
        self.append(event)

    def held(self) -> set[object]:
        blocks: set[object] = set()
        for event in self:
            if isinstance(event, KvStored):
                assert not blocks & set(event.block_ids), "stored twice"
                blocks.update(event.block_ids)
            else:
                assert isinstance(event, KvRemoved)
                assert set(event.block_ids) <= blocks, "removed what was not held"
                blocks.difference_update(event.block_ids)
        return blocks


def test_both_tiers_are_kv_tiers(tmp_path: Path) -> None:
    assert isinstance(MemoryKvTier(10), KvTier)
    assert isinstance(DiskKvTier(tmp_path, 10), KvTier)


def test_memory_tier_evicts_the_least_recently_used_to_the_tier_below(tmp_path: Path) -> None:
    host_events, disk_events = Events(), Events()
    disk = DiskKvTier(tmp_path, 1000, on_event=disk_events)
    host = MemoryKvTier(30, below=disk, on_event=host_events)
    for block in (1, 2, 3):
        assert host.put(block, bytes([block]) * 10)
    assert host.get(1) == b"\x01" * 10  # 1 is now the most recently used
    assert host.put(4, b"\x04" * 10)  # evicts 2, the least recently used
    assert host.block_ids() == [3, 1, 4]
    assert 2 not in host
    assert disk.get(2) == b"\x02" * 10
    assert host.used_bytes == 30
    assert host_events.held() == {1, 3, 4}
    assert all(event.tier == "host" for event in host_events)
    assert disk_events == [KvStored((2,), tier="disk")]
    assert not host.put(9, b"x" * 31)  # larger than the tier: passed down only
    assert 9 not in host
    assert disk.get(9) == b"x" * 31
    assert host.evict(3)
    assert not host.evict(3)
    assert 3 not in disk  # an explicit eviction drops the block


def test_disk_tier_survives_a_restart_in_lru_order(tmp_path: Path) -> None:
    tier = DiskKvTier(tmp_path, 10_000, namespace="model-a")
    for block in (5, 6, 7):
        tier.put(block, bytes([block]) * 100)
        os.utime(tier.directory / f"i{block:x}.kv", (block, block))
    again = DiskKvTier(tmp_path, 10_000, namespace="model-a")
    assert again.block_ids() == [5, 6, 7]
    assert again.get(6) == b"\x06" * 100
    assert again.used_bytes == tier.used_bytes
    assert DiskKvTier(tmp_path, 10_000, namespace="model-b").block_ids() == []
    small = DiskKvTier(tmp_path, 2 * again.used_bytes // 3, namespace="model-a")
    assert small.block_ids() == [7, 6]  # 5 was the least recently used: evicted at start


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "empty", "swap", "garbage"],
)
def test_a_damaged_disk_file_is_deleted_and_never_loaded(tmp_path: Path, damage: str) -> None:
    events = Events()
    tier = DiskKvTier(tmp_path, 10_000, on_event=events)
    tier.put(1, b"one" * 50)
    tier.put(2, b"two" * 50)
    path = tier.directory / "i1.kv"
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:-7])
    elif damage == "flip":
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "swap":  # block 2's (valid) file under block 1's name
        path.write_bytes((tier.directory / "i2.kv").read_bytes())
    else:
        path.write_bytes(os.urandom(len(raw)))
    reopened = damage == "garbage"
    if reopened:  # also after a restart
        tier = DiskKvTier(tmp_path, 10_000, on_event=events)
    assert tier.get(1) is None
    assert not path.exists()
    assert 1 not in tier
    assert events[-1] == KvRemoved((1,), tier="disk")
    assert tier.get(2) == b"two" * 50  # the others are untouched


def test_disk_tier_writes_atomically_and_cleans_up_unfinished_writes(tmp_path: Path) -> None:
    tier = DiskKvTier(tmp_path, 10_000)
    leftover = tier.directory / ".tmp-i3.kv-1-1"
    leftover.write_bytes(b"half a block")
    (tier.directory / "notes.txt").write_text("not ours")
    again = DiskKvTier(tmp_path, 10_000)
    assert not leftover.exists()
    assert (tier.directory / "notes.txt").exists()
    assert again.block_ids() == []
    assert again.put("a string id", b"data")
    assert again.get("a string id") == b"data"
    assert DiskKvTier(tmp_path, 10_000).block_ids() == ["a string id"]
    with pytest.raises(TypeError):
        again.put((1, 2), b"data")
    with pytest.raises(ValueError, match="namespace"):
        DiskKvTier(tmp_path, 10, namespace="../escape")


_operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 9), st.integers(1, 40)),
        st.tuples(st.just("get"), st.integers(0, 9), st.just(0)),
        st.tuples(st.just("evict"), st.integers(0, 9), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(operations=_operations, capacity=st.integers(0, 120))
def test_a_memory_tier_over_a_disk_tier_is_an_lru_of_sizes(
    tmp_path_factory: pytest.TempPathFactory, operations: list[tuple[str, int, int]], capacity: int
) -> None:
    """Against a reference LRU: what each tier holds, its size bound, and its events."""
    host_events, disk_events = Events(), Events()
    disk = DiskKvTier(tmp_path_factory.mktemp("disk"), 10**6, on_event=disk_events)
    host = MemoryKvTier(capacity, below=disk, on_event=host_events)
    reference: dict[int, bytes] = {}  # insertion order = LRU order
    for op, block, size in operations:
        if op == "put":
            data = bytes([block]) * size
            if block in reference:
                reference[block] = reference.pop(block)
            elif size <= capacity:
                reference[block] = data
                while sum(map(len, reference.values())) > capacity:
                    del reference[next(iter(reference))]
            host.put(block, data)
        elif op == "get":
            expected = reference.get(block)
            if expected is not None:
                reference[block] = reference.pop(block)
            assert host.get(block) == expected
        else:
            assert host.evict(block) == (reference.pop(block, None) is not None)
        assert host.block_ids() == list(reference)
        assert host.used_bytes == sum(map(len, reference.values())) <= capacity
        assert host_events.held() == set(reference)
        assert disk_events.held() == set(disk.block_ids())
    for block in disk.block_ids():
        assert disk.get(block) == bytes([block]) * len(disk.get(block) or b"")
