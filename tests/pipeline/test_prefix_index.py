"""PrefixIndex: leading-block overlaps against a naive reference, updates, events in order.

Block ids here are what chained ids stand for: a block's id names the whole prefix up to
it, so the tests spell a prompt's ids as its prefixes (``("a",), ("a", "b"), ...``).
Prompts over a two-letter alphabet share prefixes often, as conversations and system
prompts do.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import prefix_index
from pipeline.prefix_index import (
    PENDING_LIMIT,
    KvCleared,
    KvEvent,
    KvRemoved,
    KvSnapshot,
    KvStored,
    PrefixIndex,
    event_from_dict,
)

WORKERS = ("w0", "w1", "w2", "w3", "w4", "w5")


def ids(prompt: str) -> list[tuple[str, ...]]:
    """The chained block ids of ``prompt``, one block per character."""
    return [tuple(prompt[: i + 1]) for i in range(len(prompt))]


def leading(held: set[Hashable], request: Sequence[Hashable]) -> int:
    """The naive reference: leading blocks of ``request`` in ``held``."""
    count = 0
    for block in request:
        if block not in held:
            break
        count += 1
    return count


def reference_overlaps(
    truth: dict[str, set[Hashable]], request: Sequence[Hashable]
) -> dict[str, int]:
    found = {worker: leading(held, request) for worker, held in truth.items()}
    return {worker: count for worker, count in found.items() if count}


def assert_matches(index: PrefixIndex, truth: dict[str, set[Hashable]], queries: list[str]) -> None:
    for query in queries:
        assert index.overlaps(ids(query)) == reference_overlaps(truth, ids(query)), query
    for worker in WORKERS:
        assert index.blocks(worker) == len(truth.get(worker, ()))
    union = set().union(*truth.values()) if truth else set()
    assert len(index) == len(union)
    for block in union:
        holding = {worker for worker, held in truth.items() if block in held}
        assert index.holders(block) == holding
    assert index.workers() == {worker for worker, held in truth.items() if held}


# -- examples ---------------------------------------------------------------------------------


def test_overlaps_count_only_leading_blocks() -> None:
    index = PrefixIndex()
    index.stored("a", ids("xyz"))
    index.stored("b", ids("xy"))
    index.stored("c", ids("xyz")[1:])  # holds later blocks without the first: no prefix
    index.stored("d", [ids("xyz")[0], ids("xyz")[2]])  # a hole at the second block
    assert index.overlaps(ids("xyzw")) == {"a": 3, "b": 2, "d": 1}
    assert index.overlaps(ids("xq")) == {"a": 1, "b": 1, "d": 1}
    assert index.overlaps(ids("q")) == {}
    assert index.overlaps([]) == {}


def test_updates_removals_clears_and_snapshots() -> None:
    index = PrefixIndex()
    index.stored("a", ids("abc"))
    index.stored("a", ids("abc"))  # again: no change
    index.stored("b", ids("ab"))
    assert (len(index), index.blocks("a"), index.blocks("b")) == (3, 3, 2)
    index.removed("a", [ids("abc")[1], ("never", "stored")])
    assert index.overlaps(ids("abc")) == {"a": 1, "b": 2}
    index.cleared("b")
    assert index.overlaps(ids("abc")) == {"a": 1}
    assert index.holders(("a", "b")) == frozenset()
    index.snapshot("a", ids("ab"))
    assert index.overlaps(ids("abc")) == {"a": 2}
    assert (len(index), index.blocks("a"), index.blocks("b")) == (2, 2, 0)
    index.remove_worker("a")
    assert (len(index), index.workers(), index.overlaps(ids("abc"))) == (0, frozenset(), {})
    assert repr(index) == "PrefixIndex(0 blocks, {})"


def test_a_removed_worker_drops_its_entries_and_no_one_elses() -> None:
    index = PrefixIndex()
    for worker in ("w0", "w1", "w2", "w3"):
        index.stored(worker, ids("shared" + worker[-1]))
    index.remove_worker("w1")
    assert index.overlaps(ids("shared1")) == {"w0": 6, "w2": 6, "w3": 6}
    assert index.blocks("w1") == 0
    assert len(index) == 6 + 3  # the shared blocks and one own block for each of the others


def test_runs_split_by_evictions_and_restores_give_exact_counts() -> None:
    """One worker left: the walk follows what it stored together (its runs)."""
    index = PrefixIndex()
    chain = ids("abcdefghij")
    index.stored("a", chain)  # one run of ten
    assert index.overlaps(ids("abcdefgxyz")) == {"a": 7}  # the request leaves the run
    index.removed("a", [chain[4]])  # a hole in the middle splits it
    assert index.overlaps(chain) == {"a": 4}
    index.stored("a", [chain[4]])  # a run of one fills it
    assert index.overlaps(chain) == {"a": 10}
    index.removed("a", [chain[9], chain[0]])  # the tail, then the head
    assert index.overlaps(chain) == {}
    index.stored("a", chain[:1])
    assert index.overlaps(chain) == {"a": 9}
    for block in ids("klmnop"):  # a block per call, as decode output may be reported
        index.stored("b", [block])
    assert index.overlaps(ids("klmnopq")) == {"b": 6}


class Counted:
    """A block id that counts how often it is hashed or compared."""

    calls = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        Counted.calls += 1
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        Counted.calls += 1
        return isinstance(other, Counted) and other.value == self.value


@pytest.mark.parametrize("indexed", [1_000, 50_000])
def test_a_query_touches_only_the_requests_blocks_whatever_the_index_size(indexed: int) -> None:
    index = PrefixIndex()
    for start in range(0, indexed, 100):
        blocks = [Counted(value) for value in range(start, start + 100)]
        index.stored(f"w{start // 100 % 7}", blocks)
    request = [Counted(value) for value in range(300, 364)]  # 64 blocks, all held by "w3"
    Counted.calls = 0
    assert index.overlaps(request) == {"w3": 64}
    # one hash per block, plus an equality check on each hit: never a scan of the index
    assert Counted.calls <= 2 * len(request)


# -- properties against the reference ---------------------------------------------------------

prompts = st.text(alphabet="ab", min_size=1, max_size=8)
workers = st.sampled_from(WORKERS)
positions = st.integers(0, 7)
operations = st.one_of(
    # a chain from some block on (an engine reports only the blocks it newly computed)
    st.tuples(st.just("stored"), workers, prompts, positions),
    # any blocks, holes in a run included
    st.tuples(st.just("removed"), workers, prompts, st.sets(positions)),
    st.tuples(st.just("cleared"), workers),
    st.tuples(st.just("snapshot"), workers, st.lists(prompts, max_size=3)),
    st.tuples(st.just("remove_worker"), workers),
)


@pytest.mark.parametrize("follow", [0, 1, 100], ids=["walk", "follow-one", "follow-all"])
@settings(max_examples=300, deadline=None)
@given(st.lists(operations, max_size=40), st.lists(prompts, min_size=1, max_size=8))
def test_the_index_equals_a_naive_reference_after_any_updates(
    follow: int, ops: list[tuple[Any, ...]], queries: list[str]
) -> None:
    """Whether the walk looks up every block or follows runs from some number of workers
    down, the answers are the reference's."""
    index = PrefixIndex()
    truth: dict[str, set[Hashable]] = {}
    with patch.object(prefix_index, "_FOLLOW", follow):
        for op in ops:
            kind, worker = op[0], op[1]
            held = truth.setdefault(worker, set())
            if kind == "stored":
                blocks = ids(op[2])[op[3] :]
                index.stored(worker, blocks)
                held.update(blocks)
            elif kind == "removed":
                chain = ids(op[2])
                blocks = [chain[i] for i in sorted(op[3]) if i < len(chain)]
                index.removed(worker, blocks)
                held.difference_update(blocks)
            elif kind == "cleared":
                index.cleared(worker)
                held.clear()
            elif kind == "snapshot":
                blocks = [block for prompt in op[2] for block in ids(prompt)]
                index.snapshot(worker, blocks)
                truth[worker] = set(blocks)
            else:
                index.remove_worker(worker)
                del truth[worker]
            assert_matches(index, truth, queries)


def worker_events(draws: list[tuple[str, str, int]]) -> list[tuple[KvEvent, set[Hashable]]]:
    """A worker's event stream (seq 1, 2, ...) and its true cache after each event."""
    held: set[Hashable] = set()
    stream: list[tuple[KvEvent, set[Hashable]]] = []
    for seq, (kind, prompt, cut) in enumerate(draws, start=1):
        event: KvEvent
        if kind == "stored":
            event = KvStored(tuple(ids(prompt)), seq)
            held = held | set(event.block_ids)
        elif kind == "removed":
            event = KvRemoved(tuple(ids(prompt)[cut:]), seq)
            held = held - set(event.block_ids)
        else:
            event = KvCleared(seq)
            held = set()
        stream.append((event, held))
    return stream


event_draws = st.lists(
    st.tuples(
        st.sampled_from(["stored", "stored", "removed", "cleared"]), prompts, st.integers(0, 5)
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    event_draws,
    st.data(),
)
def test_lost_events_are_caught_up_by_a_snapshot_arriving_anywhere(
    draws: list[tuple[str, str, int]], data: st.DataObject
) -> None:
    """Events are lost; a snapshot of the worker as of some event is delivered at any
    point after it was taken; duplicates may be delivered. As long as no event after the
    snapshot's seq is lost, the index ends equal to the worker's cache and in sync; it
    reports being in sync all along when nothing was lost."""
    stream = worker_events(draws)
    taken = data.draw(st.integers(0, len(stream)), label="snapshot after event")
    lost = data.draw(st.sets(st.integers(1, max(1, taken))), label="lost seqs") if taken else set()
    delivered: list[KvEvent] = [event for event, _ in stream if event.seq not in lost]
    snapshot = KvSnapshot(tuple(stream[taken - 1][1]) if taken else (), taken)
    at = data.draw(st.integers(0, len(delivered)), label="snapshot delivered at")
    delivered.insert(at, snapshot)
    if len(delivered) > 1 and data.draw(st.booleans(), label="a duplicate"):
        repeat = data.draw(st.integers(0, len(delivered) - 2))
        delivered.insert(repeat + 1, delivered[repeat])

    index = PrefixIndex()
    index.stored("other", ids("ab"))
    answers = [index.apply("w0", event) for event in delivered]
    final = stream[-1][1]
    assert index.apply("w0", KvStored((), len(stream) + 1)) is True
    assert_matches(index, {"w0": set(final), "other": set(ids("ab"))}, ["a", "ab", "aaa", "bab"])
    # in sync from the start unless something before the snapshot was lost
    if not lost:
        assert all(answers)
    else:
        assert answers[-1] is True


def test_a_gap_reports_out_of_sync_until_the_snapshot_and_replays_what_came_after_it() -> None:
    index = PrefixIndex()
    assert index.apply("w", KvStored(tuple(ids("ab")), 1)) is True
    assert index.apply("w", KvStored(tuple(ids("b")), 3)) is False  # seq 2 was lost
    assert index.overlaps(ids("b")) == {"w": 1}  # applied anyway: the best guess
    assert index.apply("w", KvRemoved(tuple(ids("ab")[1:]), 4)) is False
    assert index.apply("w", KvCleared()) is False  # unsequenced: applied, still out of sync
    # the snapshot as of seq 3 (2 had stored "aa"); event 4 is replayed on top of it
    assert index.apply("w", KvSnapshot((*ids("aa"), *ids("ab"), *ids("b")), 3)) is True
    assert index.overlaps(ids("aa")) == {"w": 2}
    assert index.overlaps(ids("ab")) == {"w": 1}
    assert index.apply("w", KvStored(tuple(ids("ba")), 4)) is True  # a duplicate: ignored
    assert index.overlaps(ids("ba")) == {"w": 1}
    assert index.apply("w", KvSnapshot((), 2)) is True  # an old snapshot: ignored
    assert index.blocks("w") == 3


def test_a_gap_in_the_replay_still_asks_for_a_snapshot() -> None:
    index = PrefixIndex()
    assert index.apply("w", KvStored(tuple(ids("a")), 5)) is False  # a late frontend
    assert index.apply("w", KvStored(tuple(ids("b")), 7)) is False
    assert index.apply("w", KvSnapshot(tuple(ids("c")), 5)) is False  # 6 is still missing
    assert index.overlaps(ids("b")) == {"w": 1}  # 7 is applied as the best guess
    assert index.overlaps(ids("a")) == {}
    assert index.apply("w", KvSnapshot(tuple(ids("cb")), 7)) is True
    assert index.apply("w", KvStored(tuple(ids("d")), 8)) is True
    assert index.overlaps(ids("cbd"))["w"] == 2


def test_pending_events_are_bounded_and_their_loss_shows_as_another_gap() -> None:
    index = PrefixIndex()
    assert index.apply("w", KvStored((0,), 2)) is False
    for seq in range(3, PENDING_LIMIT + 10):
        index.apply("w", KvStored((seq,), seq))
    # the events it kept are replayed, but the ones it dropped leave it out of sync
    assert index.apply("w", KvSnapshot((1, 2), 2)) is False
    assert index.blocks("w") == PENDING_LIMIT + 1
    assert index.apply("w", KvStored((-1,), PENDING_LIMIT + 10)) is False
    assert index.apply("w", KvSnapshot(tuple(range(1, PENDING_LIMIT + 10)), PENDING_LIMIT + 9))
    assert index.blocks("w") == PENDING_LIMIT + 10  # the snapshot and the event after it


def test_remove_worker_forgets_its_event_order() -> None:
    index = PrefixIndex()
    assert index.apply("w", KvStored((1,), 1)) is True
    assert index.apply("w", KvStored((2,), 2)) is True
    index.remove_worker("w")
    assert index.apply("w", KvStored((3,), 1)) is True  # a restart numbered afresh
    assert index.blocks("w") == 1


_ids = st.lists(st.integers(0, 2**64 - 1)).map(tuple)
_seqs = st.none() | st.integers(0)
_tiers = st.sampled_from(["device", "host", "disk"])


@given(
    st.one_of(
        st.builds(KvStored, _ids, _seqs, _tiers),
        st.builds(KvRemoved, _ids, _seqs, _tiers),
        st.builds(KvCleared, _seqs, _tiers),
        st.builds(
            KvSnapshot,
            _ids,
            _seqs,
            st.dictionaries(st.sampled_from(["host", "disk"]), _ids).map(
                lambda tiers: tuple(tiers.items())
            ),
        ),
    )
)
def test_events_round_trip_through_plain_dicts(event: KvEvent) -> None:
    plain = event.to_dict()
    assert all(isinstance(value, str | int | list | dict | type(None)) for value in plain.values())
    assert event_from_dict(plain) == event
    if getattr(event, "tier", "device") == "device" and not getattr(event, "tiers", ()):
        assert set(plain) <= {"kind", "seq", "block_ids"}  # what peers without tiers read


# -- tiers ------------------------------------------------------------------------------------


def test_lower_tiers_are_kept_apart_from_the_device() -> None:
    index = PrefixIndex()
    assert index.apply("w", KvStored(tuple(ids("ab")), 1))
    assert index.apply("w", KvStored(tuple(ids("abcd")[2:]), 2, "host"))
    assert index.apply("w", KvStored(tuple(ids("abcdef")[4:]), 3, "disk"))
    assert index.overlaps(ids("abcdefg")) == {"w": 2}  # the device alone
    assert index.tiered_overlaps(ids("abcdefg")) == {"w": (2, 4)}
    assert index.blocks("w") == 2
    assert index.blocks("w", "host") == 2
    assert index.holders(ids("abc")[2], "host") == {"w"}
    assert not index.holders(ids("abc")[2])
    assert index.tiers() == {"host", "disk"}
    assert index.apply("w", KvRemoved((ids("abcd")[3],), 4, "host"))  # a hole in the run
    assert index.tiered_overlaps(ids("abcdefg")) == {"w": (2, 1)}
    assert index.apply("w", KvCleared(5))  # the device only
    assert index.tiered_overlaps(ids("abcdefg")) == {}  # nobody holds the first block
    assert index.tiered_overlaps(ids("abcx")[2:]) == {"w": (0, 1)}  # starts mid-prompt
    assert index.apply("w", KvStored(tuple(ids("a")), 6, "disk"))
    assert index.tiered_overlaps(ids("abcdefg")) == {"w": (0, 1)}  # "ab" is nowhere now
    assert index.apply("w", KvStored(tuple(ids("ab")[1:]), 7, "host"))
    assert index.tiered_overlaps(ids("abcdefg")) == {"w": (0, 3)}  # disk, host, then a hole


def test_a_snapshot_replaces_every_tier_and_remove_worker_forgets_them() -> None:
    index = PrefixIndex()
    index.apply("w", KvStored(tuple(ids("xy")), 1, "host"))
    index.apply("v", KvStored(tuple(ids("ab")), None, "host"))
    snapshot = KvSnapshot(tuple(ids("a")), 2, (("disk", tuple(ids("ab")[1:])),))
    assert index.apply("w", snapshot)
    assert index.blocks("w", "host") == 0  # absent from the snapshot: holds nothing there
    assert index.tiered_overlaps(ids("abc")) == {"w": (1, 1), "v": (0, 2)}
    index.remove_worker("w")
    assert index.tiered_overlaps(ids("abc")) == {"v": (0, 2)}
    assert index.blocks("w", "disk") == 0


def test_an_unknown_event_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'evicted'"):
        event_from_dict({"kind": "evicted", "block_ids": []})
