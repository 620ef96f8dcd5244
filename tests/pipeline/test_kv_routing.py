"""KvRouter: prefix against load, ties, softmax sampling, approximation with a TTL, and a
Router over a WorkerSet whose scripted workers report KV events.

A prompt is a string and its block ids are its prefixes, one block per character (what
chained ids stand for), so ``"sys" + "q1"`` shares three blocks with ``"sys" + "q2"``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from pipeline import Context, KvRouter, KvStored, PrefixIndex, Router, Worker, WorkerSet
from pipeline.testing import ScriptedEngine, collect, make_context


def ids(prompt: str) -> list[tuple[str, ...]]:
    return [tuple(prompt[: i + 1]) for i in range(len(prompt))]


def prompt_ids(ctx: Context[Any]) -> list[tuple[str, ...]]:
    return ids(str(ctx.data))


def pool(*names: str) -> list[Worker[Any, Any]]:
    return [Worker(name, ScriptedEngine([name])) for name in names]


def choose(policy: KvRouter, workers: list[Worker[Any, Any]], prompt: str) -> str:
    return policy.choose(workers, make_context(prompt)).id


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- cost: prefix against load ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_the_longest_prefix_wins_when_loads_are_equal(seed: int) -> None:
    index = PrefixIndex()
    index.stored("a", ids("sys"))
    index.stored("b", ids("sysab"))
    index.stored("c", ids("xyz"))
    policy = KvRouter(index, prompt_ids, seed=seed)
    assert choose(policy, pool("a", "b", "c", "d"), "sysabc") == "b"
    assert choose(policy, pool("a", "c", "d"), "sysabc") == "a"  # b is not a candidate


def test_load_and_prefix_trade_off_by_the_overlap_weight() -> None:
    index = PrefixIndex()
    index.stored("a", ids("ab"))
    workers = pool("a", "b")
    workers[0].in_flight = 3  # (a worker reporting nothing: its requests, decode_weight each)
    # weight 1: a = 2 tokens to prefill + 3 sequences = 5; b = 4 to prefill + 0 = 4
    policy = KvRouter(index, prompt_ids, overlap_weight=1.0, decode_weight=1.0)
    assert choose(policy, workers, "abcd") == "b"
    # weight 2, the default: a = 4 + 3 = 7, b = 8 + 0 = 8
    assert choose(KvRouter(index, prompt_ids, decode_weight=1.0), workers, "abcd") == "a"
    # weight 0: only load counts
    assert choose(KvRouter(index, prompt_ids, overlap_weight=0.0), workers, "abcd") == "b"
    # a sequence is worth 16 prompt tokens by default: 4 + 48 against 8
    assert choose(KvRouter(index, prompt_ids), workers, "abcd") == "b"


def test_a_custom_load_function_replaces_requests_in_flight() -> None:
    index = PrefixIndex()
    index.stored("a", ids("abcd"))
    active_blocks = {"a": 100.0, "b": 0.0}
    policy = KvRouter(index, prompt_ids, load=lambda worker: active_blocks[worker.id])
    assert choose(policy, pool("a", "b"), "abcd") == "b"


def test_ties_are_broken_at_random_and_seedably() -> None:
    index = PrefixIndex()
    for worker in "abc":
        index.stored(worker, ids("sys"))
    workers = pool("a", "b", "c", "d")  # d lacks the prefix: never the cheapest
    picks = [choose(KvRouter(index, prompt_ids, seed=seed), workers, "sysq") for seed in range(40)]
    assert set(picks) == {"a", "b", "c"}
    policy, again = KvRouter(index, prompt_ids, seed=3), KvRouter(index, prompt_ids, seed=3)
    assert [choose(policy, workers, "sys") for _ in range(20)] == [
        choose(again, workers, "sys") for _ in range(20)
    ]


def test_a_prompt_shorter_than_a_block_goes_by_load() -> None:
    decisions: list[tuple[str, int, int]] = []
    policy = KvRouter(
        PrefixIndex(), lambda ctx: [], on_decision=lambda *args: decisions.append(args)
    )
    workers = pool("a", "b")
    workers[0].in_flight = 1
    assert choose(policy, workers, "") == "b"
    assert decisions == [("b", 0, 0)]


# -- softmax sampling -------------------------------------------------------------------------


def test_softmax_sampling_picks_lower_costs_more_often_in_proportion() -> None:
    index = PrefixIndex()
    index.stored("a", ids("abcd"))  # cost 0
    index.stored("b", ids("abc"))  # cost 1
    index.stored("c", ids("ab"))  # cost 2
    workers = pool("a", "b", "c")
    policy = KvRouter(index, prompt_ids, overlap_weight=1.0, temperature=1.0, seed=11)
    draws = 4000
    counts = Counter(choose(policy, workers, "abcd") for _ in range(draws))
    weights = {"a": 1.0, "b": math.exp(-1.0), "c": math.exp(-2.0)}
    total = sum(weights.values())
    for worker, weight in weights.items():
        p = weight / total
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(counts[worker] - draws * p) < 5 * sigma, (worker, counts)
    assert counts["a"] > counts["b"] > counts["c"] > 0


def test_a_tiny_temperature_is_the_cheapest_and_a_huge_one_is_uniform() -> None:
    index = PrefixIndex()
    index.stored("a", ids("abcd"))
    workers = pool("a", "b")
    cold = KvRouter(index, prompt_ids, temperature=1e-6, seed=1)
    assert {choose(cold, workers, "abcd") for _ in range(200)} == {"a"}
    hot = KvRouter(index, prompt_ids, temperature=1e9, seed=1)
    counts = Counter(choose(hot, workers, "abcd") for _ in range(2000))
    assert abs(counts["a"] - 1000) < 5 * math.sqrt(500)  # 5 sigma of a fair coin


# -- approximation (engines without KV events) ------------------------------------------------


def test_approximation_routes_the_next_turn_to_the_first_turns_worker_until_the_ttl() -> None:
    clock = FakeClock()
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    index = PrefixIndex()
    policy = KvRouter(
        index,
        prompt_ids,
        approximate=True,
        ttl=120.0,
        stride=1,  # every block remembered: the index shows exactly what was routed
        clock=clock,
        load=lambda worker: loads[worker.id],
        seed=5,
    )
    workers = pool("a", "b", "c")
    first = choose(policy, workers, "hello")
    assert index.overlaps(ids("hello")) == {first: 5}
    loads[first] = 2.0  # busier now, but the history it holds is worth more
    clock.now += 60
    assert choose(policy, workers, "hello|there") == first
    clock.now += 100  # 160 s after turn 1 but 100 after turn 2: turn 2 refreshed them
    assert index.overlaps(ids("hello|there!")) == {first: 11}
    assert choose(policy, workers, "hello|there!") == first
    clock.now += 120  # the ttl after the last turn: nothing is assumed cached any more
    assert choose(policy, workers, "hello|there!?") != first
    assert index.blocks(first) == 0


def test_approximation_keeps_each_conversation_on_its_worker() -> None:
    clock = FakeClock()
    policy = KvRouter(PrefixIndex(), prompt_ids, approximate=True, clock=clock, seed=2)
    workers = pool("a", "b", "c", "d")
    conversations = [f"{n}:" for n in range(12)]
    owners = [choose(policy, workers, conversation + "q") for conversation in conversations]
    assert len(set(owners)) > 1  # first turns share no prefix: spread by the random ties
    for turn in range(3):
        clock.now += 30
        for conversation, owner in zip(conversations, owners, strict=True):
            assert choose(policy, workers, f"{conversation}q{'aq' * (turn + 1)}") == owner


def test_approximation_expires_only_blocks_not_routed_again_since() -> None:
    clock = FakeClock()
    index = PrefixIndex()
    policy = KvRouter(index, prompt_ids, approximate=True, ttl=10.0, clock=clock)
    (a,) = pool("a")
    choose(policy, [a], "xy")
    clock.now += 5
    choose(policy, [a], "xz")  # refreshes "x"
    clock.now += 6  # "xy" expired; "x" and "xz" have 4 s left
    choose(policy, pool("b"), "q")  # expiry happens when deciding
    assert index.overlaps(ids("xy")) == {"a": 1}
    assert index.overlaps(ids("xz")) == {"a": 2}
    clock.now += 4
    choose(policy, pool("b"), "q")
    assert index.blocks("a") == 0


def test_a_removed_worker_rejoining_keeps_its_new_approximated_blocks() -> None:
    clock = FakeClock()
    index = PrefixIndex()
    policy = KvRouter(index, prompt_ids, approximate=True, ttl=10.0, clock=clock)
    (a,) = pool("a")
    choose(policy, [a], "xy")
    index.remove_worker("a")  # it left: its blocks are gone
    assert index.overlaps(ids("xy")) == {}
    clock.now += 2
    choose(policy, [a], "xy")  # it came back and was routed the prompt again
    clock.now += 9  # the first record's expiry passes; the second's has 1 s left
    choose(policy, pool("b"), "q")
    assert index.overlaps(ids("xy")) == {"a": 2}


def test_a_stride_keys_the_head_then_every_strideth_block_and_the_last() -> None:
    index = PrefixIndex()
    decisions: list[tuple[str, int, int]] = []
    policy = KvRouter(
        index,
        prompt_ids,
        approximate=True,
        stride=4,
        on_decision=lambda *args: decisions.append(args),
    )
    (a,) = pool("a")
    prompt = "abcdefghijklmn"  # 14 blocks: keys 0, 1, 2, 3, 7, 11 and the last, 13
    choose(policy, [a], prompt)
    assert index.blocks("a") == 7
    assert index.holders(tuple(prompt[:8])) == {"a"}
    assert index.holders(tuple(prompt[:5])) == frozenset()
    choose(policy, [a], prompt)  # the same prompt again: every key held, so every block
    choose(policy, [a], prompt + "op")  # 16 blocks: keys to 11 held, 15 not: 12 known
    choose(policy, [a], "abx")  # a short prompt is keyed whole: 2 of 3 held
    assert decisions == [("a", 0, 14), ("a", 14, 0), ("a", 12, 4), ("a", 2, 1)]


def test_outside_approximation_the_stride_is_moot() -> None:
    index = PrefixIndex()
    index.stored("a", ids("abcdef"))  # what a worker's events said: every block
    decisions: list[tuple[str, int, int]] = []
    policy = KvRouter(index, prompt_ids, stride=4, on_decision=lambda *args: decisions.append(args))
    choose(policy, pool("a"), "abcdefgh")
    assert decisions == [("a", 6, 2)]
    assert "stride" not in repr(policy)


def test_without_approximation_the_router_never_writes_the_index() -> None:
    index = PrefixIndex()
    policy = KvRouter(index, prompt_ids)
    choose(policy, pool("a"), "abc")
    assert len(index) == 0


# -- decisions and validation -----------------------------------------------------------------


def test_every_decision_reports_the_worker_and_its_hit_and_miss_blocks() -> None:
    index = PrefixIndex()
    index.stored("a", ids("abc"))
    decisions: list[tuple[str, int, int]] = []
    policy = KvRouter(index, prompt_ids, on_decision=lambda *args: decisions.append(args))
    choose(policy, pool("a"), "abcdef")
    choose(policy, pool("b"), "abcdef")
    assert decisions == [("a", 3, 3), ("b", 0, 6)]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"overlap_weight": -1.0}, "overlap_weight"),
        ({"overlap_weight": math.inf}, "overlap_weight"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"ttl": 0.0}, "ttl"),
        ({"stride": 0}, "stride"),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvRouter(PrefixIndex(), prompt_ids, **arguments)


def test_repr_names_the_mode() -> None:
    policy = KvRouter(PrefixIndex(), prompt_ids, approximate=True, ttl=30)
    assert repr(policy) == (
        "KvRouter(weight=2, restore_cost=0.1, decode_weight=16, balance=1.5, temperature=0, "
        "approximate ttl=30s stride=8, PrefixIndex(0 blocks, {}))"
    )


# -- through a Router -------------------------------------------------------------------------


def reporting_workers(index: PrefixIndex, *names: str) -> WorkerSet[Any, str]:
    """Workers that answer their name and report the prompt's blocks as cached, as an
    engine with a prefix cache would (sequenced events, applied as a transport would)."""
    sequence = dict.fromkeys(names, 0)

    def serve(name: str) -> Callable[[Context[Any]], list[str]]:
        def outputs(ctx: Context[Any]) -> list[str]:
            sequence[name] += 1
            assert index.apply(name, KvStored(tuple(prompt_ids(ctx)), sequence[name]))
            return [name]

        return outputs

    return WorkerSet("decode", {name: ScriptedEngine(serve(name)) for name in names})


async def test_a_router_sends_each_conversations_next_turn_where_its_history_is_cached() -> None:
    index = PrefixIndex()
    hits = Counter[str]()
    router = Router(
        reporting_workers(index, "a", "b", "c"),
        KvRouter(
            index, prompt_ids, seed=4, on_decision=lambda worker, hit, _: hits.update({worker: hit})
        ),
    )
    conversations = [f"{n}:" for n in "abcdefghi"]
    owners = [(await collect(router, make_context(c + "q")))[0] for c in conversations]
    assert len(set(owners)) > 1
    for turn in range(1, 4):
        for conversation, owner in zip(conversations, owners, strict=True):
            prompt = conversation + "q" + "aq" * turn
            assert await collect(router, make_context(prompt)) == [owner]
    # each turn hits the whole previous prompt: 3, 5 then 7 blocks
    assert sum(hits.values()) == 9 * (3 + 5 + 7)
    assert router.statistics().in_flight == 0


async def test_equal_prefixes_spread_the_load_across_workers() -> None:
    index = PrefixIndex()
    for name in "abc":
        index.stored(name, ids("system"))
    workers = WorkerSet("decode", {name: ScriptedEngine([name], then="hang") for name in "abc"})
    router = Router(workers, KvRouter(index, prompt_ids, seed=9))
    contexts = [make_context(f"system{n}") for n in range(6)]
    async with anyio.create_task_group() as tg:
        for ctx in contexts:
            tg.start_soon(collect, router, ctx)
            await anyio.wait_all_tasks_blocked()
        assert workers.statistics().in_flight_by_worker == {"a": 2, "b": 2, "c": 2}
        for ctx in contexts:
            ctx.stop_generating()
    assert workers.statistics().in_flight == 0


async def test_a_worker_that_left_the_set_is_never_chosen_even_with_the_best_prefix() -> None:
    index = PrefixIndex()
    index.stored("gone", ids("abcdef"))
    router = Router(reporting_workers(index, "a", "b"), KvRouter(index, prompt_ids))
    assert await collect(router, make_context("abcdef")) in (["a"], ["b"])


# -- tiers: a restore is cheaper than a prefill, dearer than a slot hit ---------------------------


def test_a_host_hit_weighs_between_a_device_hit_and_a_miss() -> None:
    index = PrefixIndex()
    index.apply("device", KvStored(tuple(ids("sys-conversation"))))
    index.apply("host", KvStored(tuple(ids("sys-conversation")), tier="host"))
    index.apply("miss", KvStored(tuple(ids("sys"))))
    decisions: list[tuple[str, int, int]] = []
    policy = KvRouter(
        index,
        prompt_ids,
        overlap_weight=1.0,
        restore_cost=0.25,
        on_decision=lambda *d: decisions.append(d),
    )
    prompt = "sys-conversation!"
    assert choose(policy, pool("device", "host", "miss"), prompt) == "device"
    assert choose(policy, pool("host", "miss"), prompt) == "host"
    assert decisions[-1] == ("host", 16, 1)  # its lower-tier blocks count as hits
    # host: 1 miss + 13 restored * 0.25 + its load; miss: 14 misses
    loads = {"host": 3.0, "miss": 0.0}
    busy = KvRouter(
        index, prompt_ids, overlap_weight=1.0, restore_cost=0.25, load=lambda w: loads[w.id]
    )
    assert choose(busy, pool("host", "miss"), prompt) == "host"
    loads["host"] = 14 - 3.25 + 0.01
    assert choose(busy, pool("host", "miss"), prompt) == "miss"
    free = KvRouter(index, prompt_ids, restore_cost=0.0)
    assert choose(free, pool("device", "host"), prompt) in {"device", "host"}  # a tie
    with pytest.raises(ValueError, match="restore_cost"):
        KvRouter(index, prompt_ids, restore_cost=1.5)


def test_a_prefix_split_across_device_and_host_is_counted_whole() -> None:
    index = PrefixIndex()
    index.apply("a", KvStored(tuple(ids("syst"))))  # the system prompt in a slot
    index.apply("a", KvStored(tuple(ids("system-chat")[4:]), tier="host"))  # its chat in RAM
    index.apply("b", KvStored(tuple(ids("system-ch"))))
    policy = KvRouter(index, prompt_ids, restore_cost=0.1)
    # a: 4 device + 7 host = 11 held (0.7 to restore); b: 9 held, 2 to prefill
    assert choose(policy, pool("a", "b"), "system-chat") == "a"
