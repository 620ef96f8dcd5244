"""The scenarios of :func:`pipeline.testing.check_operator`, one per rule of the contract.

Each scenario builds fresh operators from the factory, drives them against a
:class:`~pipeline.testing.ScriptedEngine` the way a graph would, and raises
:class:`Violation` naming the rule it saw broken. Scenarios make their Contexts with
:meth:`Scenario.context` so that the runner's watchdog can kill them all at the deadline.
"""

from __future__ import annotations

import reprlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, final

import anyio

from ._scripted import ScriptedEngine
from .context import Context
from .errors import RequestError, StreamDisconnected
from .link import link
from .operator import Engine, Operator, Stream
from .streams import FunctionEngine, open_stream

__all__ = (
    "CHECKS",
    "CLOSE_DOWNSTREAM",
    "END_WHEN_CLOSED",
    "ERRORS_UNCHANGED",
    "KILL",
    "NO_SCOPE_ACROSS_YIELD",
    "OWN_TASK",
    "RETRY_CHECK",
    "STATE_IN_CONTEXT",
    "Check",
    "Scenario",
    "Violation",
)

Factory = Callable[[], Operator[Any, Any, Any, Any]]

# The rules, as they are named in failure messages.
CALL_DOWNSTREAM = "call downstream with the caller's context"
CLOSE_DOWNSTREAM = "close downstream when the consumer stops early"
END_WHEN_CLOSED = "end when closed"
OWN_TASK = "iterate downstream in the operator's own task"
ERRORS_UNCHANGED = "let downstream errors through unchanged"
KILL = "end promptly on kill, by cancellation"
NO_SCOPE_ACROSS_YIELD = "no task group or cancel scope open across a yield"
STATE_IN_CONTEXT = "keep per-request state in ctx.state"

_short = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
_short.maxlist, _short.maxstring, _short.maxother = 8, 60, 80
_repr = _short.repr


class Violation(Exception):
    """Raised by a scenario: ``rule`` was broken, ``message`` says how."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(rule, message)
        self.rule = rule
        self.message = message


@final
@dataclass
class Scenario:
    """What one check needs: the operator factory, the request, the downstream script."""

    name: str
    factory: Factory
    request: Any
    downstream_outputs: Sequence[Any]
    before_attempt: Callable[[Context[Any]], object] | None = None
    #: every root Context this scenario made (the watchdog kills them at the deadline)
    contexts: list[Context[Any]] = field(default_factory=list)
    #: every stream this scenario opened (kept alive when the check fails, see conformance)
    streams: list[object] = field(default_factory=list)

    def context(self) -> Context[Any]:
        """A fresh root Context for the request, known to the watchdog."""
        ctx = Context.new(self.request)
        self.contexts.append(ctx)
        return ctx


@final
@dataclass(frozen=True)
class Check:
    """One scenario and the title failure messages use for it."""

    title: str
    run: Callable[[Scenario], Awaitable[None]]


class _ProbeError(RequestError):
    """The error check_operator injects downstream to see that it comes back unchanged."""


async def _drain(engine: Engine[Any, Any], ctx: Context[Any], streams: list[object]) -> list[Any]:
    outputs: list[Any] = []
    async with open_stream(engine, ctx) as stream:
        streams.append(stream)
        async for item in stream:
            outputs.append(item)  # noqa: PERF401 - a kill must keep what already arrived
    return outputs


async def _full_run(s: Scenario) -> None:
    engine: ScriptedEngine[Any] = ScriptedEngine(s.downstream_outputs)
    ctx = s.context()
    await _drain(link(s.factory(), engine), ctx, s.streams)
    if not engine.requests:
        raise Violation(CALL_DOWNSTREAM, "never called downstream.generate()")
    for seen in engine.requests:
        if seen.id != ctx.id:
            raise Violation(
                CALL_DOWNSTREAM,
                f"downstream saw context id {seen.id!r}, the caller sent {ctx.id!r}; "
                "pass ctx.replace(...) or ctx.child(...) downstream, not a new Context",
            )
    if engine.open_streams:
        raise Violation(CLOSE_DOWNSTREAM, "left a downstream stream open after finishing")


async def _early_stop(s: Scenario) -> None:
    """The consumer stops early: the operator ends, and downstream is closed with it."""
    engine: ScriptedEngine[Any] = ScriptedEngine(s.downstream_outputs, then="hang")
    calls_at_close: int | None = None

    def retried() -> bool:
        return calls_at_close is not None and len(engine.requests) > calls_at_close

    try:
        async with open_stream(link(s.factory(), engine), s.context()) as stream:
            s.streams.append(stream)
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
            calls_at_close = len(engine.requests)
    except RuntimeError as exc:
        if retried():
            raise _retried_after_close() from exc
        raise
    if retried():
        raise _retried_after_close()
    if engine.open_streams:
        raise Violation(
            CLOSE_DOWNSTREAM, "the consumer stopped early but the downstream stream is still open"
        )


def _retried_after_close() -> Violation:
    return Violation(
        END_WHEN_CLOSED,
        "called downstream again after its stream was closed; closing raises GeneratorExit "
        "in generate(): catch Exception, never BaseException, and never retry on it",
    )


async def _errors_pass_through(s: Scenario) -> None:
    probe = _ProbeError("downstream failed (injected by check_operator)")
    engine: ScriptedEngine[Any] = ScriptedEngine(s.downstream_outputs, then=probe)
    try:
        await _drain(link(s.factory(), engine), s.context(), s.streams)
    except _ProbeError as exc:
        if exc is not probe:
            raise Violation(ERRORS_UNCHANGED, "re-raised a copy of the downstream error") from exc
    except Exception as exc:
        raise Violation(
            ERRORS_UNCHANGED,
            f"turned the downstream error {probe!r} into {exc!r}; "
            "operators must let downstream exceptions through unchanged",
        ) from exc
    else:
        raise Violation(
            ERRORS_UNCHANGED,
            f"swallowed the downstream error {probe!r}; "
            "operators must let downstream exceptions through unchanged",
        )


async def _kill(s: Scenario) -> None:
    """kill() while downstream hangs ends the stream promptly, by cancellation."""
    engine: ScriptedEngine[Any] = ScriptedEngine(s.downstream_outputs, then="hang")
    ctx = s.context()
    after_kill: list[Any] = []
    ended_as_complete = False
    async with anyio.create_task_group() as tg:

        async def kill_when_hanging() -> None:
            await engine.hanging.wait()
            ctx.kill()

        tg.start_soon(kill_when_hanging)
        with anyio.move_on_after(1.0) as slow:
            async with open_stream(link(s.factory(), engine), ctx) as stream:
                s.streams.append(stream)
                async for item in stream:
                    if ctx.is_killed:
                        after_kill.append(item)  # noqa: PERF401 - must see each item as it comes
                # Only reached when the operator ended its stream normally.
                ended_as_complete = ctx.is_killed
        tg.cancel_scope.cancel()
    if slow.cancelled_caught:
        raise Violation(KILL, "did not stop within 1s of kill() while downstream hung")
    if after_kill:
        raise Violation(
            KILL, f"yielded {after_kill[0]!r} after kill(); let the cancellation propagate"
        )
    if ended_as_complete:
        raise Violation(
            KILL,
            "swallowed the cancellation from kill() and ended its stream as if complete; "
            "never catch cancellation without re-raising it",
        )
    if engine.open_streams:
        raise Violation(KILL, "left the downstream stream open after kill()")


async def _retry(s: Scenario) -> None:
    """Downstream is lost after each prefix; a retry must resume, not restart."""
    outputs = s.downstream_outputs
    reference = await _drain(_Retrying(s, [ScriptedEngine(outputs)]), s.context(), s.streams)
    for lost_after in range(len(outputs)):
        lost = StreamDisconnected("worker lost (injected by check_operator)")
        engines = [
            ScriptedEngine(outputs[:lost_after], then=lost),
            ScriptedEngine(outputs[lost_after:]),
        ]
        retrying = _Retrying(s, engines)
        got = await _drain(retrying, s.context(), s.streams)
        if retrying.swallowed:
            raise Violation(
                ERRORS_UNCHANGED,
                f"swallowed the downstream error {lost!r}, so the request could not be "
                "retried; operators must let downstream exceptions through unchanged",
            )
        if got != reference:
            raise Violation(
                STATE_IN_CONTEXT,
                f"downstream was lost after {lost_after} output(s) and the request retried: "
                f"the caller got {_repr(got)} instead of {_repr(reference)}; keep what a "
                "retry must resume in ctx.state (a StateKey), not in generate()'s locals or "
                "on the operator (this holds below a retrying operator, e.g. below Migration; "
                "an operator above it is never retried: check it without retry=True)",
            )


@final
class _Retrying:
    """An Engine that does what Migration does: one fresh operator per attempt, a child
    context of the same request for each, and a retry when downstream is lost."""

    def __init__(self, s: Scenario, engines: list[ScriptedEngine[Any]]) -> None:
        self._s = s
        self._engines = engines
        self.swallowed = False

    def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        return FunctionEngine(self._attempts).generate(ctx)

    async def _attempts(self, ctx: Context[Any]) -> Stream[Any]:
        for attempt, engine in enumerate(self._engines):
            if self._s.before_attempt is not None:
                self._s.before_attempt(ctx)
            last = attempt == len(self._engines) - 1
            stream = link(self._s.factory(), engine).generate(ctx.child(ctx.data))
            self._s.streams.append(stream)
            try:
                async for output in stream:
                    yield output
            except StreamDisconnected:
                if last:
                    raise
                continue
            finally:
                await stream.aclose()
            if not last:
                self.swallowed = True
            return


#: the checks every operator gets, in order
CHECKS: tuple[Check, ...] = (
    Check("full run", _full_run),
    Check("early stop", _early_stop),
    Check("downstream error", _errors_pass_through),
    Check("kill", _kill),
)
#: the optional retry check (``check_operator(..., retry=True)``)
RETRY_CHECK = Check("retry", _retry)
