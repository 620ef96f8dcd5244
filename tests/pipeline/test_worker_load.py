"""The KV router's load term: reports, the ledger the Router keeps, the guard, affinity.

Prompts are strings and their block ids their prefixes, one block (one token) per
character, as in ``test_kv_routing.py``.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest

from pipeline import (
    Affinity,
    Context,
    KvRouter,
    LoadLedger,
    PrefixIndex,
    Router,
    Worker,
    WorkerLoad,
    WorkerSet,
)
from pipeline.testing import ScriptedEngine, collect, make_context
from pipeline.worker_load import PREDICTED_PREFILL


def ids(prompt: str) -> list[tuple[str, ...]]:
    return [tuple(prompt[: i + 1]) for i in range(len(prompt))]


def prompt_ids(ctx: Context[Any]) -> list[tuple[str, ...]]:
    return ids(str(ctx.data))


class Reporting:
    """An engine that says its load (what the router reads with ``load_report()``)."""

    def __init__(self, load: WorkerLoad | None = None) -> None:
        self.load = load

    def load_report(self) -> WorkerLoad | None:
        return self.load

    async def generate(self, ctx: Context[Any], /) -> Any:  # pragma: no cover - not run
        yield ctx.data


def worker(name: str, load: WorkerLoad | None = None) -> Worker[Any, Any]:
    return Worker(name, Reporting(load))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the report -----------------------------------------------------------------------------------


def test_a_report_is_its_queued_prefill_plus_a_decode_weight_per_sequence() -> None:
    load = WorkerLoad(prefill_tokens=500, decoding=3, waiting=2)
    assert load.work(16.0) == 500 + 16 * 5
    assert load.work(0.0) == 500


def test_a_report_crosses_a_wire_and_is_stamped_by_its_receiver() -> None:
    load = WorkerLoad(prefill_tokens=7, decoding=1, waiting=2, kv_usage=0.5, at=3.0)
    plain = load.to_dict()
    assert "at" not in plain
    assert WorkerLoad.from_dict(plain, at=9.0) == WorkerLoad(7, 1, 2, 0.5, 9.0)
    assert WorkerLoad.from_dict(WorkerLoad(1).to_dict(), at=0.0).kv_usage is None


@pytest.mark.parametrize(
    "plain",
    [{}, {"prefill": 1, "decoding": 0}, {"prefill": "x", "decoding": 0, "waiting": 0},
     {"prefill": -1, "decoding": 0, "waiting": 0}, {"prefill": 1, "decoding": 0, "waiting": 0,
     "kv": "full"}],
)  # fmt: skip
def test_a_malformed_report_is_refused(plain: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="report"):
        WorkerLoad.from_dict(plain, at=0.0)


# -- the ledger -------------------------------------------------------------------------------


def test_the_ledger_follows_a_request_from_sent_to_prefilled_to_ended() -> None:
    ledger = LoadLedger()
    first = ledger.sent(100.0, at=1.0, blocks=("a",), prompt=400.0)
    second = ledger.sent(50.0, at=2.0)
    assert (ledger.requests, ledger.prefill_tokens, ledger.prompt_tokens) == (2, 150.0, 450.0)
    assert ledger.work(10.0) == 150 + 20
    assert list(ledger.pending()) == [("a",)]
    ledger.prefilled(first)
    assert (ledger.prefill_tokens, list(ledger.pending())) == (50.0, [])
    ledger.ended(first)
    ledger.ended(first)  # twice is once
    ledger.ended(second)  # ended before any output: its prefill is no longer owed either
    assert (ledger.requests, ledger.prefill_tokens, ledger.prompt_tokens) == (0, 0.0, 0.0)
    assert ledger.sent_total == 2


def test_a_report_adds_only_what_is_not_this_routers() -> None:
    ledger = LoadLedger()
    ledger.sent(10.0, at=1.0, prompt=300.0)  # counted in a report made at 5 (whole: 300)
    ledger.sent(20.0, at=6.0, prompt=200.0)  # not yet
    # the report says 1000 tokens and 4 sequences: 700 and 3 of them are someone else's
    report = WorkerLoad(prefill_tokens=1000, decoding=2, waiting=2, at=5.0)
    assert ledger.others(report, decode_weight=10.0) == 700 + 10 * 3
    # a report that counted ours at less than their whole prompt: nobody else's tokens
    assert ledger.others(WorkerLoad(prefill_tokens=100, decoding=1, at=5.0), 10.0) == 0


# -- the router's weight of a worker ----------------------------------------------------------


def test_a_silent_worker_weighs_this_routers_requests_and_a_reporting_one_adds_the_rest() -> None:
    policy = KvRouter(PrefixIndex(), prompt_ids, decode_weight=10.0)
    silent, busy = worker("silent"), worker("busy", WorkerLoad(prefill_tokens=300, decoding=2))
    silent.ledger.sent(40.0, at=0.0)
    assert policy.work(silent) == 40 + 10
    assert policy.work(busy) == 300 + 20
    unbooked = worker("unbooked")
    unbooked.in_flight = 3  # a policy used without a Router: its in-flight count is a floor
    assert policy.work(unbooked) == 30


def test_each_request_books_its_predicted_prefill_until_its_first_output() -> None:
    index = PrefixIndex()
    index.stored("a", ids("abc"))
    policy = KvRouter(index, prompt_ids, overlap_weight=1.0, decode_weight=0.0)
    ctx = make_context("abcdef")
    chosen = policy.choose([worker("a"), worker("b")], ctx)
    assert chosen.id == "a"
    prediction = ctx.state.get(PREDICTED_PREFILL)
    assert (prediction.tokens, prediction.prompt, len(prediction.blocks)) == (3, 6, 6)


async def test_the_router_keeps_the_ledger_of_what_it_sent() -> None:
    index = PrefixIndex()
    engine = ScriptedEngine(["first"], then="hang")
    workers = WorkerSet("decode", {"a": engine})
    router = Router(workers, KvRouter(index, prompt_ids, decode_weight=0.0))
    ledger = workers.members[0].ledger
    ctx = make_context("abcd")
    seen = anyio.Event()

    async def run() -> None:
        stream = router.generate(ctx)
        assert await stream.__anext__() == "first"
        seen.set()
        async for _ in stream:
            pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await seen.wait()
        assert ledger.requests == 1
        assert ledger.prefill_tokens == 0  # its first output came
        assert ledger.sent_total == 1
        ctx.stop_generating()
    assert ledger.requests == 0
    assert PREDICTED_PREFILL not in ctx.state


async def test_a_prompt_queued_on_a_worker_counts_as_cached_there_before_any_event() -> None:
    """A burst of one prefix: the second request's prefix is not in the index yet (the
    first has not been prefilled), but it will be by the time the second is."""
    index = PrefixIndex()
    workers = WorkerSet("decode", {name: ScriptedEngine([name], then="hang") for name in "ab"})
    router = Router(workers, KvRouter(index, prompt_ids, decode_weight=0.0, balance=0, seed=1))
    long = "s" * 40
    first, second = make_context(long + "1"), make_context(long + "2")
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, router, first)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(collect, router, second)
        await anyio.wait_all_tasks_blocked()
        # a: 1 token to prefill (x2) + 41 queued = 43; b: 41 (x2) = 82
        assert workers.statistics().in_flight_by_worker == {"a": 2, "b": 0} or (
            workers.statistics().in_flight_by_worker == {"a": 0, "b": 2}
        )
        first.stop_generating()
        second.stop_generating()


# -- the guard --------------------------------------------------------------------------------


def test_a_busy_worker_over_its_share_is_passed_over_while_another_is_idle() -> None:
    index = PrefixIndex()
    index.stored("a", ids("system-prompt"))
    policy = KvRouter(index, prompt_ids, decode_weight=1.0, seed=3)
    workers = [worker("a"), worker("b"), worker("c")]
    picks = []
    for n in range(4):
        chosen = policy.choose(workers, make_context(f"system-prompt{n}"))
        chosen.ledger.sent(1.0, at=0.0)  # (it stays busy)
        picks.append(chosen.id)
    # a holds the prompt: it takes requests while its recent count is under 1.5 times the
    # mean + 1 (0 < 1; 0.97 < 1.5; 1.97 < 2), then b and c, idle, get the next ones
    assert picks[:3] == ["a", "a", "a"]
    assert picks[3] in {"b", "c"}


def test_without_an_idle_worker_the_guard_lets_the_cheapest_have_it() -> None:
    index = PrefixIndex()
    index.stored("a", ids("system-prompt"))
    policy = KvRouter(index, prompt_ids, decode_weight=1.0, seed=3)
    workers = [worker("a"), worker("b", WorkerLoad(decoding=1))]
    for n in range(6):
        chosen = policy.choose(workers, make_context(f"system-prompt{n}"))
        chosen.ledger.sent(1.0, at=0.0)
        assert chosen.id == "a"


def test_balance_zero_turns_the_guard_off() -> None:
    index = PrefixIndex()
    index.stored("a", ids("system-prompt"))
    policy = KvRouter(index, prompt_ids, decode_weight=1.0, balance=0)
    workers = [worker("a"), worker("b")]
    for n in range(6):
        chosen = policy.choose(workers, make_context(f"system-prompt{n}"))
        chosen.ledger.sent(1.0, at=0.0)
        assert chosen.id == "a"


# -- affinity ---------------------------------------------------------------------------------


def session_of(ctx: Context[Any]) -> str | None:
    prompt = str(ctx.data)
    return prompt.split(":", 1)[0] if ":" in prompt else None


def test_a_conversation_stays_on_its_worker_while_its_load_allows() -> None:
    clock = FakeClock()
    policy = KvRouter(PrefixIndex(), prompt_ids, session=session_of, clock=clock, balance=0, seed=1)
    a, b = worker("a"), worker("b")
    first = policy.choose([a, b], make_context("chat:hello"))
    other = b if first is a else a
    # no KV events: nothing says the first worker caches the chat, the key does
    first.ledger.sent(0.0, at=0.0)  # one sequence there now: 16 against 2 * 10
    assert policy.choose([a, b], make_context("chat:hello.more")) is first
    for _ in range(2):  # two more: 48 > 2 * 15, the whole prompt elsewhere
        first.ledger.sent(0.0, at=0.0)
    assert policy.choose([a, b], make_context("chat:hello.more.")) is other
    # the conversation moved: it sticks to its new worker now
    assert policy.choose([a, b], make_context("chat:hello.more..")) is other


def test_a_conversation_is_forgotten_a_ttl_after_its_last_request() -> None:
    clock = FakeClock()
    policy = KvRouter(
        PrefixIndex(), prompt_ids, session=session_of, affinity_ttl=10.0, clock=clock, seed=7
    )
    a, b = worker("a"), worker("b")
    owner = policy.choose([a, b], make_context("chat:x"))
    for _ in range(5):
        clock.now += 9
        assert policy.choose([a, b], make_context("chat:x")) is owner
    clock.now += 10
    picks = {policy.choose([a, b], make_context(f"chat{n}:x")).id for n in range(20)}
    assert picks == {"a", "b"}  # other conversations spread by the random ties


def test_affinity_is_bounded_by_age_and_by_count() -> None:
    affinity = Affinity(ttl=5.0, limit=3)
    for n in range(5):
        affinity.put(f"k{n}", "w", now=float(n))
    assert len(affinity) == 3
    assert affinity.get("k0", now=4.0) is None  # pushed out by the limit
    assert affinity.get("k4", now=4.0) == "w"
    assert affinity.get("k2", now=7.0) is None  # 5 s after its request
    affinity.forget("w")
    assert len(affinity) == 0
    with pytest.raises(ValueError, match="ttl"):
        Affinity(ttl=math.nan)
    with pytest.raises(ValueError, match="limit"):
        Affinity(ttl=1.0, limit=0)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"decode_weight": -1.0}, "decode_weight"),
        ({"decode_weight": math.inf}, "decode_weight"),
        ({"balance": 0.5}, "balance"),
        ({"balance": math.nan}, "balance"),
        ({"block_size": 0}, "block_size"),
        ({"affinity_ttl": -1.0}, "ttl"),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvRouter(PrefixIndex(), prompt_ids, **arguments)
