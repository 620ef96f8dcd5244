"""Routers: each policy, waiting for capacity, membership changes in flight, statistics."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import (
    CapacityExhausted,
    Context,
    Direct,
    Engine,
    EngineError,
    LeastLoaded,
    MemoryDiscovery,
    Random,
    RoundRobin,
    Router,
    Stream,
    WorkerSet,
    link,
    open_stream,
)
from pipeline.testing import ScriptedEngine, collect, make_context


def named(name: str, then: Any = None) -> ScriptedEngine[str]:
    """A worker engine whose single output is its own name."""
    return ScriptedEngine([name], then=then)


def worker_set(*names: str, then: Any = None, name: str = "decode") -> WorkerSet[Any, str]:
    return WorkerSet(name, {n: named(n, then) for n in names})


async def serve(router: Router[Any, str], **metadata: str) -> str:
    """Route one request and return the name of the worker that answered."""
    (answer,) = await collect(router, make_context("req", metadata=metadata))
    return answer


class Started:
    """Runs requests in a task group and lets the test wait until each has been routed."""

    def __init__(self, tg: anyio.abc.TaskGroup, router: Router[Any, str]) -> None:
        self._tg = tg
        self._router = router
        self.contexts: list[Context[str]] = []
        self.answers: list[list[str]] = []

    async def start(self, **metadata: str) -> Context[str]:
        """Start a request and return once it has its first output (or is waiting)."""
        ctx = make_context("req", metadata=metadata)
        self.contexts.append(ctx)
        answers: list[str] = []
        self.answers.append(answers)

        async def run() -> None:
            async with open_stream(self._router, ctx) as stream:
                async for item in stream:
                    answers.append(item)

        self._tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        return ctx


# -- policies ---------------------------------------------------------------------------------


async def test_round_robin_cycles_through_the_members_in_join_order() -> None:
    router = Router(worker_set("a", "b", "c"), RoundRobin())
    assert [await serve(router) for _ in range(7)] == list("abcabca")


async def test_round_robin_is_the_default_policy() -> None:
    router = Router(worker_set("a", "b"))
    assert [await serve(router) for _ in range(4)] == list("abab")


async def test_random_picks_only_members_covers_them_all_and_is_seedable() -> None:
    workers = worker_set("a", "b", "c")
    router = Router(workers, Random(seed=7))
    picks = [await serve(router) for _ in range(60)]
    assert set(picks) == {"a", "b", "c"}
    again = Router(workers, Random(seed=7))
    assert [await serve(again) for _ in range(60)] == picks


async def test_least_loaded_picks_the_member_with_fewest_requests_in_flight() -> None:
    workers = worker_set("a", "b", "c", then="hang")
    router = Router(workers, LeastLoaded())
    async with anyio.create_task_group() as tg:
        started = Started(tg, router)
        for _ in range(4):
            await started.start()
        # a, b, c each got one; the fourth tie went to the first member
        assert list(started.answers) == [["a"], ["b"], ["c"], ["a"]]
        assert workers.statistics().in_flight_by_worker == {"a": 2, "b": 1, "c": 1}
        started.contexts[1].stop_generating()  # b's request ends: b is now least loaded
        await anyio.wait_all_tasks_blocked()
        await started.start()
        assert started.answers[-1] == ["b"]
        for ctx in started.contexts:
            ctx.stop_generating()
    assert workers.statistics().in_flight == 0


async def test_direct_routes_by_the_worker_id_in_metadata() -> None:
    router = Router(worker_set("a", "b", "c"), Direct())
    assert [await serve(router, worker_id=w) for w in "cab"] == ["c", "a", "b"]


async def test_direct_may_select_by_a_custom_function() -> None:
    router = Router(worker_set("a", "b"), Direct(lambda ctx: ctx.metadata["pin"]))
    assert await serve(router, pin="b") == "b"


async def test_direct_to_an_unknown_worker_names_it() -> None:
    router = Router(worker_set("a"), Direct())
    with pytest.raises(CapacityExhausted, match=r"worker 'zz'.*'decode'"):
        await serve(router, worker_id="zz")


async def test_a_router_links_like_any_engine_and_passes_errors_through() -> None:
    class Shout:
        async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
            async for item in downstream.generate(ctx):
                yield item.upper()

    error = EngineError("worker failed")
    workers = WorkerSet("decode", {"a": named("a"), "b": named("b", then=error)})
    graph = link(Shout(), Router(workers))
    assert await collect(graph, make_context("r")) == ["A"]
    with pytest.raises(EngineError) as info:
        await collect(graph, make_context("r"))
    assert info.value is error
    assert workers.statistics().in_flight == 0


# -- no capacity, and waiting for it ----------------------------------------------------------


async def test_no_workers_and_no_wait_fails_at_once_naming_the_worker_set() -> None:
    router: Router[Any, str] = Router(WorkerSet("prefill-pool"), wait=0)
    ctx = make_context("r", id="req-9")
    with pytest.raises(CapacityExhausted, match="prefill-pool") as info:
        await collect(router, ctx)
    assert info.value.request_id == "req-9"


async def test_no_workers_and_a_wait_fails_after_the_wait() -> None:
    router: Router[Any, str] = Router(WorkerSet("pool"), wait=0.05)
    with pytest.raises(CapacityExhausted, match=r"'pool' after waiting"):
        await collect(router, make_context("r"))
    assert router.statistics().waiting == 0


@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoaded(), Random(seed=1)])
async def test_a_worker_that_joins_during_the_wait_serves_the_request(policy: Any) -> None:
    discovery: MemoryDiscovery[Any, str] = MemoryDiscovery()
    workers = discovery.attach(WorkerSet("decode"))
    router = Router(workers, policy, wait=30)
    async with anyio.create_task_group() as tg:
        started = Started(tg, router)
        await started.start()
        assert router.statistics().waiting == 1
        assert started.answers == [[]]
        discovery.register("late", named("late"))
    assert started.answers == [["late"]]
    assert router.statistics().waiting == 0


async def test_direct_waits_for_its_worker_and_ignores_others_joining() -> None:
    workers: WorkerSet[Any, str] = WorkerSet("decode")
    router = Router(workers, Direct(), wait=30)
    async with anyio.create_task_group() as tg:
        started = Started(tg, router)
        await started.start(worker_id="w2")
        workers.add("w1", named("w1"))
        await anyio.wait_all_tasks_blocked()
        assert started.answers == [[]]
        assert router.statistics().waiting == 1
        workers.add("w2", named("w2"))
    assert started.answers == [["w2"]]


async def test_the_wait_ends_with_capacity_exhausted_at_the_contexts_deadline() -> None:
    # Iterated without open_stream, nothing else enforces the deadline: the router does.
    router: Router[Any, str] = Router(WorkerSet("decode"), wait=30)
    ctx = make_context("r", timeout=0.05)
    with anyio.fail_after(5), pytest.raises(CapacityExhausted, match="decode"):
        async for _ in router.generate(ctx):
            pass  # pragma: no cover


async def test_the_deadline_passing_during_the_wait_under_open_stream_is_a_kill() -> None:
    # open_stream enforces the same deadline and a passed deadline is a kill: the request
    # ends quietly, killed, and a worker joining later never sees it.
    workers: WorkerSet[Any, str] = WorkerSet("decode")
    router = Router(workers, wait=30)
    ctx = make_context("r", timeout=0.05)
    with anyio.fail_after(5):
        assert await collect(router, ctx) == []
    assert ctx.is_killed
    assert router.statistics().waiting == 0
    late = named("late")
    workers.add("late", late)
    assert late.requests == []


async def test_kill_during_the_wait_ends_the_request_quietly() -> None:
    workers: WorkerSet[Any, str] = WorkerSet("decode")
    router = Router(workers, wait=30)
    async with anyio.create_task_group() as tg:
        started = Started(tg, router)
        ctx = await started.start()
        assert router.statistics().waiting == 1
        ctx.kill()
    assert started.answers == [[]]
    assert router.statistics().waiting == 0


async def test_stop_generating_during_the_wait_ends_the_stream_empty() -> None:
    workers: WorkerSet[Any, str] = WorkerSet("decode")
    router = Router(workers, wait=30)
    async with anyio.create_task_group() as tg:
        started = Started(tg, router)
        ctx = await started.start()
        ctx.stop_generating()
    assert started.answers == [[]]
    assert not ctx.is_killed
    workers.add("late", named("late"))
    assert router.statistics().waiting == 0


async def test_a_stopped_request_is_not_sent_to_a_worker() -> None:
    engine = named("a")
    ctx = make_context("r")
    ctx.stop_generating()
    assert await collect(Router(WorkerSet("decode", {"a": engine})), ctx) == []
    assert engine.requests == []


# -- membership changes while requests are in flight ------------------------------------------


async def test_a_removed_workers_in_flight_stream_completes_and_new_requests_avoid_it() -> None:
    discovery: MemoryDiscovery[Any, str] = MemoryDiscovery()
    a = ScriptedEngine(["a1"], then="hang")
    discovery.register("a", a)
    discovery.register("b", named("b"))
    discovery.register("c", named("c"))
    workers = discovery.attach(WorkerSet("decode"))
    router = Router(workers, RoundRobin())
    async with anyio.create_task_group() as tg:
        started = Started(tg, router)
        ctx = await started.start()  # -> a, now hanging
        assert started.answers == [["a1"]]
        discovery.deregister("a")
        assert "a" not in workers
        assert workers.statistics().in_flight == 0  # a's stream no longer counts
        picks = [await serve(router) for _ in range(4)]
        ctx.stop_generating()  # a's in-flight stream ends cleanly
    assert a.completed == 1
    assert not a.closed_early
    assert len(a.requests) == 1
    assert sorted(picks) == ["b", "b", "c", "c"]
    assert picks[0::2] in (["b", "b"], ["c", "c"])  # still alternating across the new set


async def test_round_robin_takes_in_a_worker_that_joins() -> None:
    workers = worker_set("a", "b")
    router = Router(workers, RoundRobin())
    assert [await serve(router) for _ in range(2)] == ["a", "b"]
    workers.add("c", named("c"))
    picks = [await serve(router) for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


async def test_replacing_a_workers_engine_keeps_its_in_flight_count() -> None:
    workers = worker_set("a", then="hang")
    router = Router(workers, LeastLoaded())
    async with anyio.create_task_group() as tg:
        started = Started(tg, router)
        ctx = await started.start()
        workers.add("a", named("a-v2"))
        assert workers.statistics().in_flight_by_worker == {"a": 1}
        assert await serve(router) == "a-v2"
        ctx.stop_generating()
    assert workers.statistics().in_flight_by_worker == {"a": 0}


_events = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.just(0)),
        st.tuples(st.just("add"), st.integers(min_value=0, max_value=5)),
        st.tuples(st.just("remove"), st.integers(min_value=0, max_value=5)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_events)
async def test_round_robin_over_changing_membership_is_fair_and_never_stale(
    events: list[tuple[str, int]],
) -> None:
    workers: WorkerSet[Any, str] = WorkerSet("decode")
    router = Router(workers, RoundRobin())
    run: list[str] = []  # picks since the last membership change
    for kind, number in events:
        worker_id = f"w{number}"
        if kind == "request":
            if len(workers) == 0:
                with pytest.raises(CapacityExhausted):
                    await serve(router)
                continue
            pick = await serve(router)
            assert pick in workers  # never a removed worker
            run.append(pick)
            # any len(members) consecutive picks within one membership are all distinct
            window = run[-len(workers) :]
            assert len(set(window)) == len(window)
        else:
            before = [w.id for w in workers.members]
            if kind == "add":
                workers.add(worker_id, named(worker_id))
            else:
                workers.remove(worker_id)
            if [w.id for w in workers.members] != before:
                run = []


# -- discovery and statistics -----------------------------------------------------------------


def test_memory_discovery_feeds_attached_sets_until_detached() -> None:
    discovery: MemoryDiscovery[Any, str] = MemoryDiscovery()
    discovery.register("a", named("a"))
    first = discovery.attach(WorkerSet("first"))
    second = discovery.attach(WorkerSet("second"))
    assert [w.id for w in first.members] == ["a"]
    discovery.register("b", named("b"))
    discovery.detach(second)
    discovery.register("c", named("c"))
    discovery.deregister("a")
    assert [w.id for w in first.members] == ["b", "c"]
    assert [w.id for w in second.members] == ["a", "b"]


def test_removing_an_unknown_worker_is_harmless() -> None:
    workers = worker_set("a")
    workers.remove("nope")
    assert len(workers) == 1
    assert workers.get("a") is not None
    assert workers.get("nope") is None


async def test_statistics_count_members_in_flight_and_waiting() -> None:
    busy = worker_set("a", "b", then="hang", name="busy")
    empty: WorkerSet[Any, str] = WorkerSet("empty")
    assert busy.statistics() == (2, 0, 0, {"a": 0, "b": 0})
    async with anyio.create_task_group() as tg:
        on_busy = Started(tg, Router(busy))
        on_empty = Started(tg, Router(empty, wait=30))
        for _ in range(3):
            await on_busy.start()
        await on_empty.start()
        await on_empty.start()
        stats = busy.statistics()
        assert (stats.workers, stats.in_flight, stats.waiting) == (2, 3, 0)
        assert stats.in_flight_by_worker == {"a": 2, "b": 1}
        assert empty.statistics() == (0, 0, 2, {})
        for ctx in [*on_busy.contexts, *on_empty.contexts]:
            ctx.stop_generating()
    assert busy.statistics().in_flight == 0
    assert empty.statistics().waiting == 0


async def test_in_flight_is_released_when_the_consumer_stops_early() -> None:
    workers = worker_set("a", then="hang")
    router = Router(workers)
    async with open_stream(router, make_context("r")) as stream:
        async for _ in stream:
            assert router.statistics().in_flight == 1
            break
    assert router.statistics().in_flight == 0


def test_worker_set_lifecycle_follows_membership_even_unobserved() -> None:
    workers: WorkerSet[str, str] = WorkerSet("encode")
    assert workers.lifecycle == "pending"
    workers.add("a", ScriptedEngine(["x"]))
    workers.remove("a")  # joined and left with nobody looking
    assert workers.lifecycle == "unavailable"
    workers.add("b", ScriptedEngine(["y"]))
    assert workers.lifecycle == "active"
