"""link() and chain(): composition order, nesting, early close down to the engine, wiring
mistakes. (That mypy rejects a mis-ordered graph is tests/operators/test_typed_graph.py.)"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import (
    Context,
    Engine,
    EngineError,
    FunctionEngine,
    LinkError,
    Stream,
    chain,
    link,
    open_stream,
)
from pipeline.testing import ScriptedEngine, collect, make_context


class Tag:
    """Appends its name to the request on the way forward and to each output on the way back."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx.replace(f"{ctx.data}>{self.name}")):
            yield f"{item}<{self.name}"


class Recorded:
    """A pass-through operator that logs (name, task id) when its generator finishes."""

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        self.name = name
        self.log = log

    async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
        try:
            async for item in downstream.generate(ctx):
                yield item
        finally:
            self.log.append((self.name, anyio.get_current_task().id))


class RecordedEngine:
    """Yields 0..n-1; logs ("engine", task id) on close, and whether it saw GeneratorExit."""

    def __init__(self, n: int, log: list[tuple[str, int]]) -> None:
        self.n = n
        self.log = log
        self.saw_close = False

    async def generate(self, ctx: Context[Any], /) -> Stream[int]:
        try:
            for i in range(self.n):
                await checkpoint()
                yield i
        except GeneratorExit:
            self.saw_close = True
            raise
        finally:
            self.log.append(("engine", anyio.get_current_task().id))


def echo_engine(ctx: Context[str]) -> Stream[str]:
    async def gen() -> Stream[str]:
        yield ctx.data

    return gen()


# -- composition ------------------------------------------------------------------------------


async def test_link_of_an_engine_alone_is_that_engine() -> None:
    engine = ScriptedEngine(["a"])
    assert link(engine) is engine


async def test_link_is_a_right_fold() -> None:
    engine = FunctionEngine(echo_engine)
    outputs = await collect(link(Tag("a"), Tag("b"), engine), make_context("req"))
    # forward: a then b; backward: b then a
    assert outputs == ["req>a>b<b<a"]


async def test_linked_graphs_nest() -> None:
    engine = FunctionEngine(echo_engine)
    flat = await collect(link(Tag("a"), Tag("b"), Tag("c"), engine), make_context("r"))
    nested = await collect(
        link(Tag("a"), link(Tag("b"), link(Tag("c"), engine))), make_context("r")
    )
    assert nested == flat == ["r>a>b>c<c<b<a"]


async def test_an_operator_may_change_the_payload_type_and_keep_the_request() -> None:
    class Tokenize:
        async def generate(
            self, ctx: Context[str], downstream: Engine[list[int], int]
        ) -> Stream[str]:
            async for token in downstream.generate(ctx.replace([ord(c) for c in ctx.data])):
                yield chr(token)

    engine = ScriptedEngine(lambda ctx: ctx.data)
    ctx = make_context("hey", id="r1")
    assert await collect(link(Tokenize(), engine), ctx) == ["h", "e", "y"]
    assert engine.requests[0].data == [104, 101, 121]
    assert engine.requests[0].id == "r1"


async def test_downstream_errors_reach_the_caller_unchanged() -> None:
    error = EngineError("boom")
    engine = ScriptedEngine(["x"], then=error)
    with pytest.raises(EngineError) as info:
        await collect(link(Tag("a"), Tag("b"), engine), make_context("r"))
    assert info.value is error


async def test_every_stage_runs_in_the_consumers_task_and_sees_its_contextvars() -> None:
    var = contextvars.ContextVar[str]("var")
    seen: list[tuple[int, str]] = []

    class Probe:
        async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
            seen.append((anyio.get_current_task().id, var.get()))
            async for item in downstream.generate(ctx):
                yield item

    async def engine(ctx: Context[Any]) -> AsyncIterator[int]:
        seen.append((anyio.get_current_task().id, var.get()))
        yield 1

    var.set("set by the consumer")
    await collect(link(Probe(), Probe(), FunctionEngine(engine)), make_context(None))
    me = anyio.get_current_task().id
    assert seen == [(me, "set by the consumer")] * 3


# -- closing early ----------------------------------------------------------------------------


async def _consume(engine: Engine[Any, Any], ctx: Context[Any], how: str, after: int) -> None:
    """Take ``after`` items, then stop by break, by raising, or by being cancelled."""
    with anyio.CancelScope() as scope:
        try:
            async with open_stream(engine, ctx) as stream:
                received = 0
                async for _ in stream:
                    received += 1
                    if received < after:
                        continue
                    if how == "break":
                        break
                    if how == "raise":
                        raise LookupError("consumer gave up")
                    scope.cancel()
                    await checkpoint()
                    pytest.fail("not cancelled")  # pragma: no cover
        except LookupError:
            assert how == "raise"


@pytest.mark.parametrize("how", ["break", "raise", "cancel"])
async def test_an_early_stop_closes_every_generator_in_order_in_the_consumers_task(
    how: str,
) -> None:
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(10, log)
    graph = link(Recorded("a", log), Recorded("b", log), Recorded("c", log), engine)
    await _consume(graph, make_context(None), how, after=2)
    me = anyio.get_current_task().id
    assert log == [("a", me), ("b", me), ("c", me), ("engine", me)]
    assert engine.saw_close


@settings(max_examples=60, deadline=None)
@given(
    depth=st.integers(min_value=0, max_value=6),
    items=st.integers(min_value=1, max_value=5),
    data=st.data(),
)
async def test_early_stop_at_any_position_in_any_chain_closes_everything_in_order(
    depth: int, items: int, data: st.DataObject
) -> None:
    after = data.draw(st.integers(min_value=1, max_value=items), label="after")
    how = data.draw(st.sampled_from(["break", "raise", "cancel"]), label="how")
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(items, log)
    names = [f"op{i}" for i in range(depth)]
    graph = link(*[Recorded(name, log) for name in names], engine)
    await _consume(graph, make_context(None), how, after=after)
    me = anyio.get_current_task().id
    assert log == [(name, me) for name in [*names, "engine"]]
    assert engine.saw_close


async def test_a_full_run_closes_from_the_engine_outwards() -> None:
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(2, log)
    assert await collect(link(Recorded("a", log), engine), make_context(None)) == [0, 1]
    assert [name for name, _ in log] == ["engine", "a"]
    assert not engine.saw_close


async def test_streams_an_operator_abandoned_are_closed_with_its_own_stream() -> None:
    log: list[tuple[str, int]] = []
    engines = [RecordedEngine(10, log), RecordedEngine(10, log)]

    class PeekTwice:
        """Opens downstream twice, takes one item from each and never closes either."""

        async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
            for _ in range(2):
                async for item in downstream.generate(ctx):
                    yield item
                    break

    calls = iter(engines)
    inner: FunctionEngine[Any, int] = FunctionEngine(lambda ctx: next(calls).generate(ctx))
    assert await collect(link(PeekTwice(), inner), make_context(None)) == [0, 0]
    assert [engine.saw_close for engine in engines] == [True, True]
    assert [name for name, _ in log] == ["engine", "engine"]


async def test_an_operator_that_closes_downstream_itself_is_not_closed_twice() -> None:
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(10, log)

    class Tidy:
        async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
            async with aclosing(downstream.generate(ctx)) as stream:
                async for item in stream:
                    yield item

    await _consume(link(Tidy(), engine), make_context(None), "break", after=1)
    assert [name for name, _ in log] == ["engine"]
    assert engine.saw_close


class Sometimes:
    """Tags requests that start with "tag"; hands every other one downstream's own stream."""

    def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        if ctx.data.startswith("tag"):
            return Tag("t").generate(ctx, downstream)
        return downstream.generate(ctx)


async def test_a_passthrough_operator_gets_downstreams_stream_back_unwrapped() -> None:
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(10, log)
    seen: list[Stream[Any]] = []

    class Spy:
        def generate(self, ctx: Context[Any], /) -> Stream[Any]:
            stream = engine.generate(ctx)
            seen.append(stream)
            return stream

    graph = link(Sometimes(), Spy())
    stream = graph.generate(make_context("plain"))
    assert seen == [stream]  # no wrapper, so no hop per item
    assert await stream.__anext__() == 0
    await stream.aclose()
    assert engine.saw_close
    assert await collect(link(Sometimes(), ScriptedEngine(["a"])), make_context("tag")) == ["a<t"]
    assert await collect(link(Sometimes(), ScriptedEngine(["a"])), make_context("x")) == ["a"]


async def test_an_early_stop_closes_a_chain_with_passthroughs_down_to_the_engine() -> None:
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(10, log)
    graph = link(Recorded("a", log), Sometimes(), Recorded("b", log), Sometimes(), engine)
    await _consume(graph, make_context("plain"), "break", after=2)
    me = anyio.get_current_task().id
    assert log == [("a", me), ("b", me), ("engine", me)]
    assert engine.saw_close


async def test_a_stream_closed_before_its_first_item_never_starts_the_engine() -> None:
    engine = ScriptedEngine(["a"])
    async with open_stream(link(Tag("t"), engine), make_context("r")):
        pass
    assert engine.requests == []
    assert engine.open_streams == 0


# -- chain ------------------------------------------------------------------------------------


async def test_a_chain_is_its_operators_spliced_in_place() -> None:
    engine = FunctionEngine(echo_engine)
    flat = await collect(link(Tag("a"), Tag("b"), Tag("c"), Tag("d"), engine), make_context("r"))
    spliced = link(Tag("a"), chain(Tag("b"), chain(Tag("c"))), Tag("d"), engine)
    assert await collect(spliced, make_context("r")) == flat == ["r>a>b>c>d<d<c<b<a"]
    assert repr(chain(Tag("b"), chain(), chain(Tag("c")))).count("Tag") == 2  # flattened


async def test_an_empty_chain_is_a_passthrough_with_no_hop() -> None:
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(3, log)
    seen: list[Stream[Any]] = []

    class Spy:
        def generate(self, ctx: Context[Any], /) -> Stream[Any]:
            seen.append(engine.generate(ctx))
            return seen[-1]

    assert link(chain(), Spy()).generate(make_context(None)) is seen[0]
    await seen[0].aclose()
    assert await collect(link(chain(), ScriptedEngine(["a"])), make_context(None)) == ["a"]


async def test_a_chain_used_directly_as_an_operator_closes_all_it_opened() -> None:
    log: list[tuple[str, int]] = []
    engine = RecordedEngine(10, log)
    grouped = chain(Recorded("a", log), Recorded("b", log))
    stream = grouped.generate(make_context(None), engine)
    assert [await stream.__anext__(), await stream.__anext__()] == [0, 1]
    await stream.aclose()
    assert [name for name, _ in log] == ["a", "b", "engine"]
    assert engine.saw_close


def test_chain_refuses_what_is_not_an_operator() -> None:
    with pytest.raises(LinkError, match="looks like an engine"):
        chain(ScriptedEngine(["x"]))  # type: ignore[arg-type]
    with pytest.raises(LinkError, match=r"did you mean Tag\(\)"):
        chain(Tag)  # type: ignore[arg-type]


# -- wiring mistakes --------------------------------------------------------------------------


class Upper:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx):
            yield item.upper()


class ForgotToYield:
    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Any:
        return downstream.generate(ctx)


class ReturnsCoroutine:
    """generate is a plain def that hands back a coroutine: only visible on first use."""

    def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Any:
        return self._serve(ctx, downstream)

    async def _serve(self, ctx: Context[str], downstream: Engine[str, str]) -> None:
        pass


class EngineReturningCoroutine:
    def generate(self, ctx: Context[str], /) -> Any:
        return self._serve(ctx)

    async def _serve(self, ctx: Context[str]) -> None:
        pass


class EngineReturningList:
    def generate(self, ctx: Context[str], /) -> Any:
        return ["a", "b"]


class TooManyParameters:
    async def generate(
        self, ctx: Context[str], downstream: Engine[str, str], extra: int
    ) -> Stream[str]:
        yield "never"


async def an_async_generator_function(ctx: Context[str]) -> AsyncIterator[str]:
    yield "x"


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        pytest.param(lambda e: (), "at least an engine", id="nothing"),
        pytest.param(lambda e: (Upper(),), "Did you forget the engine", id="no-engine"),
        pytest.param(lambda e: (Upper(), object()), "no generate", id="not-an-engine"),
        pytest.param(lambda e: (Upper, e), r"did you mean Upper\(\)", id="class-not-instance"),
        pytest.param(
            lambda e: (an_async_generator_function,), "FunctionEngine", id="bare-function"
        ),
        pytest.param(lambda e: (e, e), "only the last argument", id="engine-as-operator"),
        pytest.param(lambda e: (ForgotToYield(), e), "forget to `yield`", id="async-def-no-yield"),
        pytest.param(lambda e: (TooManyParameters(), e), "takes 3 positional", id="arity"),
    ],
)
def test_wiring_mistakes_fail_at_link_time_naming_the_mistake(
    stages: Callable[[Engine[Any, Any]], tuple[Any, ...]], message: str
) -> None:
    with pytest.raises(LinkError, match=message):
        link(*stages(ScriptedEngine(["x"])))


async def test_an_operator_returning_a_coroutine_fails_on_first_use() -> None:
    graph = link(ReturnsCoroutine(), ScriptedEngine(["x"]))
    with pytest.raises(LinkError, match=r"ReturnsCoroutine.generate returned a coroutine.*yield"):
        await collect(graph, make_context("r"))


async def test_an_engine_returning_a_coroutine_fails_on_first_use_behind_an_operator() -> None:
    graph = link(Upper(), EngineReturningCoroutine())
    with pytest.raises(LinkError, match=r"EngineReturningCoroutine.generate returned a coroutine"):
        await collect(graph, make_context("r"))


async def test_an_engine_returning_a_coroutine_fails_on_first_use_when_driven_directly() -> None:
    with pytest.raises(LinkError, match="returned a coroutine"):
        await collect(EngineReturningCoroutine(), make_context("r"))


async def test_an_engine_returning_something_else_fails_on_first_use() -> None:
    with pytest.raises(LinkError, match="returned list, not an async iterator"):
        await collect(link(Upper(), EngineReturningList()), make_context("r"))
