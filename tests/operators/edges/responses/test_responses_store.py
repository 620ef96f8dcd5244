"""The in-memory Responses store: bounded by bytes (least recently used leave first) and by
age (a TTL from when a record was stored), on a clock the test moves."""

from __future__ import annotations

import pytest

from operators.edges.responses import MemoryResponseStore, StoredResponse
from operators.edges.responses.store import StoreFull


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_least_recently_used_records_leave_first() -> None:
    store = MemoryResponseStore(max_bytes=30, ttl=100, clock=Clock())
    for key in "abc":
        await store.put(key, b"0123456789")
    assert await store.get("a") == b"0123456789"  # a is now the most recently used
    await store.put("d", b"0123456789")  # 40 bytes would not fit: b leaves
    assert await store.get("b") is None
    assert [await store.get(key) is not None for key in "acd"] == [True, True, True]
    assert store.size == 30
    assert len(store) == 3


async def test_records_expire_after_the_ttl_from_when_they_were_stored() -> None:
    clock = Clock()
    store = MemoryResponseStore(max_bytes=100, ttl=10, clock=clock)
    await store.put("old", b"x")
    clock.now = 5
    await store.put("new", b"y")
    assert await store.get("old") == b"x"  # reading does not extend the ttl
    clock.now = 10
    assert await store.get("old") is None
    assert await store.get("new") == b"y"
    assert await store.delete("old") is False
    clock.now = 16
    assert await store.delete("new") is False  # expired: as if never there
    assert store.size == 0


async def test_a_replaced_record_counts_once_and_a_deleted_one_not_at_all() -> None:
    store = MemoryResponseStore(max_bytes=100, ttl=10, clock=Clock())
    await store.put("k", b"12345")
    await store.put("k", b"123")
    assert store.size == 3
    assert await store.delete("k") is True
    assert await store.delete("k") is False
    assert store.size == 0


async def test_a_record_larger_than_the_store_is_refused() -> None:
    store = MemoryResponseStore(max_bytes=4, ttl=10)
    with pytest.raises(StoreFull):
        await store.put("k", b"12345")
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryResponseStore(max_bytes=0)


def test_a_record_round_trips_and_its_conversation_ends_with_its_output() -> None:
    response = {"id": "resp_1", "output": [{"type": "message", "id": "msg_2"}]}
    record = StoredResponse(response, [{"type": "message", "id": "msg_1"}], "owner")
    again = StoredResponse.decode(record.encode())
    assert again == record
    assert [item["id"] for item in again.conversation] == ["msg_1", "msg_2"]
    with pytest.raises(ValueError, match="not a stored response"):
        StoredResponse.decode(b"[]")


async def test_an_owner_over_its_share_loses_its_own_records_first() -> None:
    store = MemoryResponseStore(max_bytes=40, ttl=100, clock=Clock())
    await store.put("b1", b"0123456789", owner="b")
    for key in ("a1", "a2", "a3"):
        await store.put(key, b"0123456789", owner="a")
    # full: a holds 30 of 40 bytes, over its share of 20; a's next record pushes out a's own
    await store.put("a4", b"0123456789", owner="a")
    assert await store.get("b1") is not None
    assert await store.get("a1") is None
    assert store.used_by("a") == 30
    # b, under its share, pushes out the records of the owner holding the most (a)
    await store.put("b2", b"0123456789", owner="b")
    assert [await store.get(key) is not None for key in ("b1", "b2")] == [True, True]
    assert (store.used_by("a"), store.used_by("b"), store.size) == (20, 20, 40)


async def test_one_owner_alone_may_use_the_whole_store() -> None:
    store = MemoryResponseStore(max_bytes=30, ttl=100, clock=Clock())
    for key in "abc":
        await store.put(key, b"0123456789", owner="a")
    assert store.used_by("a") == 30
    await store.put("d", b"0123456789", owner="a")
    assert await store.get("a") is None  # its least recently used
    assert len(store) == 3
