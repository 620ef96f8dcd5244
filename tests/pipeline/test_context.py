"""Context: payload and identity, typed state, replace/child, stop/kill and their waits."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline import Context, State, StateKey, StateKeyError
from pipeline.testing import make_context

COUNT = StateKey[int]("count")


# -- identity, payload, metadata -------------------------------------------------------------


def test_new_context_carries_data_id_and_metadata() -> None:
    ctx = Context.new({"prompt": "hi"}, id="req-1", metadata={"tenant": "a"})
    assert ctx.data == {"prompt": "hi"}
    assert ctx.id == "req-1"
    assert dict(ctx.metadata) == {"tenant": "a"}
    assert ctx.deadline is None


def test_new_contexts_get_distinct_ids() -> None:
    assert Context.new(1).id != Context.new(1).id


def test_metadata_is_copied_from_the_callers_mapping() -> None:
    headers = {"tenant": "a"}
    ctx = Context.new(None, metadata=headers)
    headers["tenant"] = "b"
    assert ctx.metadata["tenant"] == "a"


def test_repr_names_id_and_flags() -> None:
    ctx = Context.new(b"x", id="r")
    assert "'r'" in repr(ctx)
    assert "live" in repr(ctx)
    ctx.stop_generating()
    assert "stopped" in repr(ctx)
    ctx.kill()
    assert "killed" in repr(ctx)


# -- typed state ------------------------------------------------------------------------------


def test_state_get_returns_what_set_stored() -> None:
    ctx = make_context(None)
    ctx.state.set(COUNT, 3)
    assert ctx.state.get(COUNT) == 3
    ctx.state.set(COUNT, 4)
    assert ctx.state.get(COUNT) == 4


def test_missing_state_key_raises_a_lookup_error_naming_the_key() -> None:
    state = State()
    with pytest.raises(StateKeyError, match="count") as info:
        state.get(COUNT)
    assert isinstance(info.value, LookupError)
    assert COUNT not in state


def test_state_get_default_is_returned_only_when_missing() -> None:
    state = State()
    assert state.get(COUNT, None) is None
    state.set(COUNT, 0)
    assert state.get(COUNT, 99) == 0


def test_state_keys_compare_by_identity_not_by_name() -> None:
    a = StateKey[str]("decoder")
    b = StateKey[str]("decoder")
    state = State()
    state.set(a, "mine")
    assert b not in state
    with pytest.raises(StateKeyError):
        state.get(b)
    state.set(b, "theirs")
    assert (state.get(a), state.get(b)) == ("mine", "theirs")


def test_setdefault_keeps_an_existing_value() -> None:
    state = State()
    assert state.setdefault(COUNT, 1) == 1
    assert state.setdefault(COUNT, 2) == 1
    assert state.get(COUNT) == 1


def test_pop_removes_the_value_and_raises_when_missing() -> None:
    state = State()
    state.set(COUNT, 5)
    assert state.pop(COUNT) == 5
    assert COUNT not in state
    with pytest.raises(StateKeyError):
        state.pop(COUNT)


# -- replace ----------------------------------------------------------------------------------


def test_replace_changes_the_payload_and_shares_id_metadata_and_state() -> None:
    ctx = Context.new("text", id="r", metadata={"k": "v"})
    tokens = ctx.replace([1, 2, 3])
    assert tokens.data == [1, 2, 3]
    assert ctx.data == "text"
    assert tokens.id == "r"
    assert tokens.metadata == {"k": "v"}
    tokens.state.set(COUNT, 1)
    assert ctx.state.get(COUNT) == 1


@pytest.mark.parametrize("stop_via", ["original", "replacement"])
@pytest.mark.parametrize("action", ["stop_generating", "kill"])
def test_replace_shares_cancellation_both_ways(stop_via: str, action: str) -> None:
    ctx = Context.new("a")
    other = ctx.replace("b")
    getattr(ctx if stop_via == "original" else other, action)()
    assert ctx.is_stopped
    assert other.is_stopped
    assert ctx.is_killed == other.is_killed == (action == "kill")


# -- child ------------------------------------------------------------------------------------


def test_child_shares_id_and_state_and_copies_metadata() -> None:
    parent = Context.new("p", id="r", metadata={"k": "v"})
    child = parent.child("c")
    assert child.data == "c"
    assert child.id == "r"
    assert child.metadata == {"k": "v"}
    child.state.set(COUNT, 7)
    assert parent.state.get(COUNT) == 7


def test_child_with_its_own_state_does_not_see_the_parents() -> None:
    parent = Context.new("p")
    parent.state.set(COUNT, 1)
    child = parent.child("c", state=State())
    assert COUNT not in child.state
    child.state.set(COUNT, 2)
    assert parent.state.get(COUNT) == 1


def test_child_metadata_may_be_overridden() -> None:
    parent = Context.new("p", metadata={"worker_id": "a"})
    child = parent.child("c", metadata={"worker_id": "b"})
    assert child.metadata == {"worker_id": "b"}
    assert parent.metadata == {"worker_id": "a"}


@pytest.mark.parametrize("action", ["stop_generating", "kill"])
def test_parent_stop_and_kill_reach_every_child(action: str) -> None:
    parent = Context.new("p")
    children = [parent.child(i) for i in range(3)]
    grandchild = children[0].child("g")
    getattr(parent, action)()
    for ctx in [*children, grandchild]:
        assert ctx.is_stopped
        assert ctx.is_killed == (action == "kill")


@pytest.mark.parametrize("action", ["stop_generating", "kill"])
def test_children_made_after_the_parent_stopped_start_stopped(action: str) -> None:
    parent = Context.new("p")
    getattr(parent, action)()
    late = parent.child("late")
    assert late.is_stopped
    assert late.is_killed == (action == "kill")
    assert late.replace("again").child("deeper").is_stopped


@pytest.mark.parametrize("action", ["stop_generating", "kill"])
def test_a_childs_stop_and_kill_never_reach_the_parent_or_siblings(action: str) -> None:
    parent = Context.new("p")
    child, sibling = parent.child(1), parent.child(2)
    getattr(child, action)()
    assert child.is_stopped
    assert not parent.is_stopped
    assert not parent.is_killed
    assert not sibling.is_stopped
    assert not sibling.is_killed


def test_stop_after_kill_and_repeated_calls_are_harmless() -> None:
    ctx = Context.new(None)
    ctx.kill()
    ctx.kill()
    ctx.stop_generating()
    assert ctx.is_killed
    assert ctx.is_stopped


def test_stop_is_not_kill() -> None:
    ctx = Context.new(None)
    ctx.stop_generating()
    assert ctx.is_stopped
    assert not ctx.is_killed


def test_child_deadline_is_the_earlier_of_its_own_and_the_parents() -> None:
    parent = Context.new(None, deadline=100.0)
    assert parent.child(1).deadline == 100.0
    assert parent.child(1, deadline=50.0).deadline == 50.0
    assert parent.child(1, deadline=150.0).deadline == 100.0
    assert Context.new(None).child(1, deadline=7.0).deadline == 7.0
    assert parent.replace(2).deadline == 100.0


# The model: a context is killed iff it or an ancestor was ever killed, and stopped iff it
# or an ancestor was ever stopped or killed, whatever order creation and signals came in.
_ops = st.lists(
    st.tuples(st.sampled_from(["child", "stop", "kill"]), st.integers(min_value=0)),
    max_size=30,
)


@given(_ops)
def test_stop_and_kill_propagate_down_the_tree_and_never_up(ops: list[tuple[str, int]]) -> None:
    nodes: list[Context[int]] = [Context.new(0)]
    parents: list[int | None] = [None]
    stopped: set[int] = set()
    killed: set[int] = set()
    for op, raw in ops:
        target = raw % len(nodes)
        if op == "child":
            nodes.append(nodes[target].child(len(nodes)))
            parents.append(target)
        elif op == "stop":
            nodes[target].stop_generating()
            stopped.add(target)
        else:
            nodes[target].kill()
            killed.add(target)

    def lineage(index: int) -> set[int]:
        found: set[int] = set()
        node: int | None = index
        while node is not None:
            found.add(node)
            node = parents[node]
        return found

    for index, ctx in enumerate(nodes):
        ancestry = lineage(index)
        assert ctx.is_killed == bool(ancestry & killed)
        assert ctx.is_stopped == bool(ancestry & (killed | stopped))


# -- waiting for stop and kill ----------------------------------------------------------------


async def test_wait_stopped_returns_at_once_when_already_stopped() -> None:
    ctx = Context.new(None)
    ctx.stop_generating()
    with anyio.fail_after(1):
        await ctx.wait_stopped()


async def test_wait_stopped_wakes_when_another_task_stops_the_context() -> None:
    ctx = Context.new(None)
    woke = anyio.Event()

    async def waiter() -> None:
        await ctx.wait_stopped()
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert not woke.is_set()
        ctx.stop_generating()
        await woke.wait()


async def test_wait_stopped_on_a_child_wakes_when_the_parent_is_stopped() -> None:
    parent = Context.new(None)
    child = parent.child(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(child.wait_stopped)
        await anyio.wait_all_tasks_blocked()
        parent.stop_generating()


async def test_wait_killed_ignores_stop_and_wakes_on_kill() -> None:
    ctx = Context.new(None)
    woke = anyio.Event()

    async def waiter() -> None:
        await ctx.wait_killed()
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        ctx.stop_generating()
        await anyio.wait_all_tasks_blocked()
        assert not woke.is_set()
        ctx.kill()
        await woke.wait()


async def test_kill_wakes_wait_stopped_too() -> None:
    ctx = Context.new(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ctx.wait_stopped)
        tg.start_soon(ctx.wait_killed)
        await anyio.wait_all_tasks_blocked()
        ctx.kill()


async def test_make_context_timeout_sets_a_deadline_on_the_loop_clock() -> None:
    before = anyio.current_time()
    ctx = make_context("x", timeout=5.0)
    assert ctx.deadline is not None
    assert before + 5.0 <= ctx.deadline <= anyio.current_time() + 5.0


# -- fail: ending a stream with a reason, from another task


async def _hang(ctx: Context[str]) -> AsyncIterator[str]:
    yield "first"
    await anyio.sleep_forever()
    yield "never"


async def test_fail_from_a_leg_ends_its_driver_with_the_error() -> None:
    from pipeline import FunctionEngine, StreamDisconnected, open_stream

    root = Context.new("req")
    leg = root.child("attempt")  # what Migration hands the engine below it
    got: list[str] = []
    with anyio.fail_after(2), pytest.raises(StreamDisconnected, match="frozen"):
        async with open_stream(FunctionEngine(lambda _: _hang(leg)), root) as stream:
            async for item in stream:
                got.append(item)
                leg.fail(StreamDisconnected("frozen"))
    assert got == ["first"]
    assert leg.is_killed  # what the driver drove is cancelled
    assert not root.is_killed
    assert not root.is_stopped
    with pytest.raises(StreamDisconnected):  # a failed request fails again at once
        async with open_stream(FunctionEngine(_hang), root) as stream:
            got.extend([item async for item in stream])


def test_fail_with_no_driver_above_is_a_kill() -> None:
    ctx = make_context("req")
    leg = ctx.child("attempt")
    leg.fail(RuntimeError("nobody drives it"))
    assert leg.is_killed
    assert not ctx.is_killed
