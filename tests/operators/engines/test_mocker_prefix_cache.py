"""The mocker's prefix cache: LRU by block, KV events that match its content, prefill that
skips cached blocks (counted in its statistics and on its step clock)."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

from operators.engines._prefix_cache import PrefixCache
from operators.engines.mocker import MockerEngine
from operators.routing.kv_blocks import block_hashes
from operators.testing import make_request
from pipeline import Context, open_stream
from pipeline.prefix_index import KvCleared, KvEvent, KvRemoved, KvStored, PrefixIndex
from pipeline.testing import collect, make_context

BS = 4  # tokens per block in these tests


def mocker(**options: Any) -> MockerEngine:
    options.setdefault("prefill_ms_per_token", 0.0)
    options.setdefault("decode_ms_per_step", 0.0)
    return MockerEngine(block_size=BS, **options)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 5000) for _ in range(length)]


def held(events: list[KvEvent]) -> set[int]:
    """The blocks a sequence of events leaves held."""
    blocks: set[int] = set()
    for event in events:
        if isinstance(event, KvStored):
            blocks.update(event.block_ids)  # type: ignore[arg-type]
        elif isinstance(event, KvRemoved):
            blocks.difference_update(event.block_ids)
        elif isinstance(event, KvCleared):
            blocks.clear()
    return blocks


# -- the cache on its own ---------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_block_first() -> None:
    events: list[KvEvent] = []
    cache = PrefixCache(BS, capacity=4, sink=events.append)
    a, b, c = (block_hashes(prompt(i, 2 * BS), BS) for i in range(3))
    cache.store(a)
    cache.store(b)
    assert cache.lookup(a, 2 * BS) == 2 * BS  # a is now more recent than b
    cache.store(c)  # needs 2 blocks: b's go, tail first
    assert all(block in cache for block in a + c)
    assert not any(block in cache for block in b)
    assert events[-2] == KvRemoved((b[1], b[0]), seq=3)
    assert events[-1] == KvStored(tuple(c), seq=4)


def test_a_prompts_tail_is_evicted_before_its_head() -> None:
    cache = PrefixCache(BS, capacity=3)
    a = block_hashes(prompt(1, 3 * BS), BS)
    cache.store(a)
    cache.store(block_hashes(prompt(2, BS), BS))  # one block must go: a's last
    assert [block in cache for block in a] == [True, True, False]
    assert cache.lookup(a, 3 * BS) == 2 * BS


def test_a_prompt_longer_than_the_cache_keeps_its_first_blocks() -> None:
    cache = PrefixCache(BS, capacity=2)
    a = block_hashes(prompt(1, 5 * BS), BS)
    cache.store(a)
    assert len(cache) == 2
    assert [block in cache for block in a] == [True, True, False, False, False]


@pytest.mark.parametrize("seed", range(5))
def test_events_and_snapshots_match_the_caches_content(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex()
    events: list[KvEvent] = []

    def sink(event: KvEvent) -> None:
        events.append(event)
        assert index.apply("w", event)  # in order, no gap

    cache = PrefixCache(BS, capacity=12, sink=sink)
    bases = [prompt(seed * 100 + i, 6 * BS) for i in range(4)]
    for _ in range(60):
        tokens = rng.choice(bases)[: rng.randrange(BS, 6 * BS)] + prompt(rng.randrange(1 << 30), BS)
        blocks = block_hashes(tokens, BS)
        cache.lookup(blocks, len(tokens))
        cache.store(blocks)
        assert len(cache) <= 12
        snapshot = cache.snapshot()
        assert held(events) == set(snapshot.block_ids)
        assert index.blocks("w") == len(snapshot.block_ids)
        assert all(index.holders(block) == {"w"} for block in snapshot.block_ids)
        # prefix-closed: every held block's prompt prefix is held up to it
        assert index.overlaps(blocks[: rng.randrange(1, len(blocks) + 1)]).get("w", 0) >= 1
    # a late index caught up by the snapshot alone agrees with the event-fed one
    late = PrefixIndex()
    assert late.apply("w", cache.snapshot())
    for base in bases:
        blocks = block_hashes(base, BS)
        assert late.overlaps(blocks) == index.overlaps(blocks)
    cache.clear()
    assert held(events) == set()
    assert index.blocks("w") == 0


# -- through the engine -----------------------------------------------------------------------


async def test_a_cached_prompt_computes_only_its_uncached_tokens() -> None:
    engine = mocker(cache_blocks=64)
    first = prompt(1, 10 * BS + 2)
    await collect(engine, make_context(make_request(first, max_tokens=2)))
    stats = engine.statistics()
    assert (stats.prefill_tokens, stats.cached_prompt_tokens) == (len(first), 0)
    second = first + prompt(2, 3 * BS)  # the next turn of the conversation
    await collect(engine, make_context(make_request(second, max_tokens=2)))
    stats = engine.statistics()
    assert stats.cached_prompt_tokens == 10 * BS  # the full blocks of the first turn
    assert stats.prefill_tokens == len(first) + len(second) - 10 * BS
    exact = prompt(3, 4 * BS)
    await collect(engine, make_context(make_request(exact, max_tokens=2)))
    before = engine.statistics()
    await collect(
        engine, make_context(make_request(exact, max_tokens=2))
    )  # fully cached: nothing to compute
    after = engine.statistics()
    assert after.prefill_tokens == before.prefill_tokens
    assert after.cached_prompt_tokens == before.cached_prompt_tokens + 4 * BS


def test_a_cached_prefill_is_shorter_on_the_step_clock() -> None:
    from trio.testing import MockClock

    async def main() -> list[float]:
        engine = mocker(cache_blocks=64, prefill_ms_per_token=1.0, decode_ms_per_step=1.0)
        tokens = prompt(4, 25 * BS)  # 100 tokens: 100 ms of prefill
        took = []
        for _ in range(2):
            start = anyio.current_time()
            await collect(engine, make_context(make_request(tokens, max_tokens=1)))
            took.append(anyio.current_time() - start)
        return took

    clock = MockClock(autojump_threshold=0)
    cold, warm = anyio.run(main, backend="trio", backend_options={"clock": clock})
    assert cold == pytest.approx(0.101)  # one step: 1 ms + 100 prompt tokens x 1 ms
    assert warm == pytest.approx(0.001)  # every block cached: the step alone


async def test_the_engine_reports_events_to_a_sink_set_later() -> None:
    engine = mocker(cache_blocks=64)
    await collect(engine, make_context(make_request(prompt(1, 3 * BS), max_tokens=2)))
    index = PrefixIndex()
    events: list[KvEvent] = []
    engine.kv_events = events.append
    assert index.apply("w", engine.kv_snapshot())  # start from what it holds
    second = prompt(2, 2 * BS)
    await collect(engine, make_context(make_request(second, max_tokens=2)))
    assert all(index.apply("w", event) for event in events)
    assert index.overlaps(block_hashes(second, BS)) == {"w": 2}
    assert index.blocks("w") == 5 == len(engine.kv_snapshot().block_ids)


async def test_without_a_cache_every_prompt_is_prefilled_and_nothing_is_reported() -> None:
    engine = mocker()
    reported: list[KvEvent] = []
    engine.kv_events = reported.append
    tokens = prompt(1, 4 * BS)
    for _ in range(2):
        await collect(engine, make_context(make_request(tokens, max_tokens=2)))
    assert engine.kv_snapshot().block_ids == ()
    assert reported == []
    assert engine.kv_events is None  # nothing to report to
    assert engine.statistics().cached_prompt_tokens == 0
    with pytest.raises(ValueError, match="cache_blocks"):
        MockerEngine(cache_blocks=-1)


async def test_the_load_report_counts_queued_prefill_and_sequences() -> None:
    """One slot: the first request decodes while the second waits, its estimate the part of
    its prompt the cache does not hold (looked up when it arrived)."""
    mocker = MockerEngine(
        prefill_ms_per_token=1, decode_ms_per_step=5, max_batch=1, cache_blocks=64, block_size=16
    )
    assert mocker.load_report().work() == 0
    prompt = list(range(100, 164))  # four blocks
    first = Context.new(make_request(prompt, max_tokens=50))
    second = Context.new(make_request([*prompt, *range(200, 216)], max_tokens=2))
    async with anyio.create_task_group() as tg, open_stream(mocker, first) as stream:
        await anext(stream)  # prefilled: its blocks are cached, it decodes
        assert (mocker.load_report().decoding, mocker.load_report().waiting) == (1, 0)
        tg.start_soon(collect, mocker, second)
        await anyio.wait_all_tasks_blocked()
        report = mocker.load_report()
        assert (report.decoding, report.waiting, report.prefill_tokens) == (1, 1, 16)
        first.stop_generating()
    assert mocker.load_report().work() == 0
