"""Test doubles for people who write operators and engines (public API).

A whole test of an operator fits in three lines::

    engine = ScriptedEngine(["a", "b"])
    assert await collect(link(Upper(), engine), make_context("req")) == ["A", "B"]
    await check_operator(Upper, "req", ["a", "b", "c"])

:func:`check_operator` is a conformance suite in the manner of trio's
``check_one_way_stream``: run it once against your operator and it checks the contract every
operator in a graph must keep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar, final

import anyio
from anyio.lowlevel import checkpoint

from .context import Context
from .errors import RequestError
from .link import link
from .operator import Engine, Operator, Stream
from .routers import WorkerSet
from .streams import open_stream

__all__ = ("ScriptedEngine", "check_operator", "collect", "make_context", "worker_set")

T = TypeVar("T")
Out = TypeVar("Out")


def make_context(
    data: T,
    *,
    id: str | None = None,  # noqa: A002
    metadata: Mapping[str, str] | None = None,
    deadline: float | None = None,
    timeout: float | None = None,
) -> Context[T]:
    """A fresh root Context for ``data``.

    ``timeout`` (seconds from now, needs a running event loop) is a shorthand for
    ``deadline``.
    """
    if timeout is not None:
        deadline = anyio.current_time() + timeout
    return Context.new(data, id=id, metadata=metadata, deadline=deadline)


def worker_set(*engines: Engine[Any, Out], name: str = "workers") -> WorkerSet[Any, Out]:
    """A WorkerSet of ``engines`` with ids ``worker-0``, ``worker-1``, ...

    With :class:`ScriptedEngine` workers it makes failover testable in one line::

        workers = worker_set(
            ScriptedEngine([out1], then=StreamDisconnected("worker died")),
            ScriptedEngine([out2]),
        )
        graph = link(Migration(), Backend(tokenizer), Router(workers))
    """
    return WorkerSet(name, {f"worker-{i}": engine for i, engine in enumerate(engines)})


async def collect(engine: Engine[T, Out], ctx: Context[T]) -> list[Out]:
    """Run ``engine`` for ``ctx`` to the end and return every output.

    Driven by :func:`pipeline.open_stream`, so a kill or a passed deadline ends it early
    with what arrived so far; any exception propagates.
    """
    outputs: list[Out] = []
    async with open_stream(engine, ctx) as stream:
        # One append per item, not a comprehension: a kill must keep what already arrived.
        async for item in stream:
            outputs.append(item)  # noqa: PERF401
    return outputs


@final
class ScriptedEngine(Generic[Out]):
    """An Engine that plays back a script, for testing what sits in front of it.

    Every request gets ``outputs`` (or ``outputs(ctx)`` when it is callable), one per
    step. Then, per ``then``: None ends the stream; an exception instance is raised;
    ``"hang"`` waits until the context is stopped (a kill cancels the wait). A
    ``stop_generating()`` ends the stream cleanly before the next output.

    It records what it saw: ``requests`` (the contexts, in order), ``closed_early``
    (a stream was closed before its script ran out), ``open_streams`` and the
    ``hanging`` event (set once a stream starts to hang).
    """

    def __init__(
        self,
        outputs: Iterable[Out] | Callable[[Context[Any]], Iterable[Out]] = (),
        then: BaseException | Literal["hang"] | None = None,
    ) -> None:
        self._outputs: Sequence[Out] | Callable[[Context[Any]], Iterable[Out]] = (
            outputs if callable(outputs) else tuple(outputs)
        )
        self._then = then
        #: the context of every request, in arrival order
        self.requests: list[Context[Any]] = []
        #: True once any stream was closed before its script ran out
        self.closed_early = False
        #: streams started and not yet finished or closed
        self.open_streams = 0
        #: streams that ran their script to the end
        self.completed = 0
        self._hanging: anyio.Event | None = None

    @property
    def hanging(self) -> anyio.Event:
        """Set once a stream reaches its ``"hang"``."""
        if self._hanging is None:
            self._hanging = anyio.Event()
        return self._hanging

    def generate(self, ctx: Context[Any], /) -> Stream[Out]:
        """Record ``ctx`` and play the script."""
        self.requests.append(ctx)
        return self._play(ctx)

    async def _play(self, ctx: Context[Any]) -> Stream[Out]:
        outputs = self._outputs(ctx) if callable(self._outputs) else self._outputs
        self.open_streams += 1
        finished = False
        try:
            for output in outputs:
                await checkpoint()
                if ctx.is_stopped:
                    finished = True
                    return
                yield output
            if isinstance(self._then, BaseException):
                finished = True
                raise self._then
            if self._then == "hang":
                self.hanging.set()
                await ctx.wait_stopped()
            finished = True
            self.completed += 1
        finally:
            self.open_streams -= 1
            if not finished:
                self.closed_early = True

    def __repr__(self) -> str:
        return f"ScriptedEngine(requests={len(self.requests)})"


class _ProbeError(RequestError):
    """The error check_operator injects downstream to see that it comes back unchanged."""


async def _settle() -> None:
    for _ in range(3):
        await checkpoint()


def _task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


_Factory = Callable[[], Operator[Any, Any, Any, Any]]


async def check_operator(
    factory: Callable[[], Operator[Any, Any, Any, Any]],
    request: Any,
    downstream_outputs: Sequence[Any],
    *,
    time_limit: float = 5.0,
) -> None:
    """Check that operators built by ``factory()`` keep the operator contract.

    Each check builds a new operator, links it to a :class:`ScriptedEngine` that plays
    ``downstream_outputs`` and sends it ``request``. The operator must:

    1. call downstream, passing a context with the caller's id;
    2. close the downstream stream when its own consumer stops early (after the first
       output, or once downstream has nothing more to give), in the consumer's task;
    3. let a downstream exception through unchanged (the same object);
    4. end promptly after ``kill()`` while downstream hangs, yielding nothing more and
       letting the cancellation through;
    5. leave no task running behind it.

    Raises:
        AssertionError: naming the first rule broken.
        TimeoutError: when the checks together take longer than ``time_limit`` seconds.
    """
    name = getattr(factory, "__name__", repr(factory))
    before = _task_ids()
    with anyio.fail_after(time_limit, reason=f"{name}: check_operator ran over {time_limit:g}s"):
        await _check_context_id(name, factory, request, downstream_outputs)
        await _check_early_stop(name, factory, request, downstream_outputs)
        await _check_errors_pass_through(name, factory, request, downstream_outputs)
        await _check_kill(name, factory, request, downstream_outputs)
        await _settle()
        leftover = _task_ids() - before
        if leftover:
            raise AssertionError(
                f"{name}: left {len(leftover)} task(s) running; every task an operator starts "
                "must finish before its generate() yields or returns"
            )


async def _check_context_id(
    name: str, factory: _Factory, request: Any, downstream_outputs: Sequence[Any]
) -> None:
    """1. A full run; the caller's context id reaches downstream."""
    engine: ScriptedEngine[Any] = ScriptedEngine(downstream_outputs)
    ctx = make_context(request)
    await collect(link(factory(), engine), ctx)
    if not engine.requests:
        raise AssertionError(f"{name}: never called downstream.generate()")
    for seen in engine.requests:
        if seen.id != ctx.id:
            raise AssertionError(
                f"{name}: downstream saw context id {seen.id!r}, the caller sent {ctx.id!r}; "
                "pass ctx.replace(...) or ctx.child(...) downstream, not a new Context"
            )
    if engine.open_streams:
        raise AssertionError(f"{name}: left a downstream stream open after finishing")


async def _check_early_stop(
    name: str, factory: _Factory, request: Any, downstream_outputs: Sequence[Any]
) -> None:
    """2. The consumer stops early: downstream must be closed by the time it is done."""
    engine: ScriptedEngine[Any] = ScriptedEngine(downstream_outputs, then="hang")
    ctx = make_context(request)
    try:
        async with open_stream(link(factory(), engine), ctx) as stream:
            # Stop after the first output, or, for an operator that holds outputs back,
            # once downstream has given everything it has and hangs.
            with anyio.CancelScope() as give_up:
                async with anyio.create_task_group() as tg:

                    async def give_up_when_hanging() -> None:
                        await engine.hanging.wait()
                        give_up.cancel()

                    tg.start_soon(give_up_when_hanging)
                    async for _ in stream:
                        break
                    tg.cancel_scope.cancel()
    except RuntimeError as exc:
        if "already running" not in str(exc):
            raise
        raise AssertionError(
            f"{name}: the consumer stopped early but the downstream stream could not be "
            "closed because another task is iterating it; iterate downstream in the "
            "operator's own generate(), not in a task that outlives it"
        ) from exc
    if engine.open_streams:
        raise AssertionError(
            f"{name}: the consumer stopped early but the downstream stream is still open"
        )


async def _check_errors_pass_through(
    name: str, factory: _Factory, request: Any, downstream_outputs: Sequence[Any]
) -> None:
    """3. A downstream error comes back unchanged."""
    probe = _ProbeError("downstream failed (injected by check_operator)")
    engine: ScriptedEngine[Any] = ScriptedEngine(downstream_outputs, then=probe)
    try:
        await collect(link(factory(), engine), make_context(request))
    except _ProbeError as exc:
        if exc is not probe:
            raise AssertionError(f"{name}: re-raised a copy of the downstream error") from exc
    except Exception as exc:
        raise AssertionError(
            f"{name}: turned the downstream error {probe!r} into {exc!r}; "
            "operators must let downstream exceptions through unchanged"
        ) from exc
    else:
        raise AssertionError(
            f"{name}: swallowed the downstream error {probe!r}; "
            "operators must let downstream exceptions through unchanged"
        )


async def _check_kill(
    name: str, factory: _Factory, request: Any, downstream_outputs: Sequence[Any]
) -> None:
    """4. kill() while downstream hangs ends the stream promptly, by cancellation."""
    engine: ScriptedEngine[Any] = ScriptedEngine(downstream_outputs, then="hang")
    ctx = make_context(request)
    after_kill: list[Any] = []
    ended_as_complete = False
    async with anyio.create_task_group() as tg:

        async def kill_when_hanging() -> None:
            await engine.hanging.wait()
            ctx.kill()

        tg.start_soon(kill_when_hanging)
        with anyio.move_on_after(1.0) as slow:
            async with open_stream(link(factory(), engine), ctx) as stream:
                async for item in stream:
                    if ctx.is_killed:
                        after_kill.append(item)  # noqa: PERF401 - must see each item as it comes
                # Only reached when the operator ended its stream normally.
                ended_as_complete = ctx.is_killed
        tg.cancel_scope.cancel()
    if slow.cancelled_caught:
        raise AssertionError(f"{name}: did not stop within 1s of kill() while downstream hung")
    if after_kill:
        raise AssertionError(
            f"{name}: yielded {after_kill[0]!r} after kill(); let the cancellation propagate"
        )
    if ended_as_complete:
        raise AssertionError(
            f"{name}: swallowed the cancellation from kill() and ended its stream as if "
            "complete; never catch cancellation without re-raising it"
        )
    if engine.open_streams:
        raise AssertionError(f"{name}: left the downstream stream open after kill()")
