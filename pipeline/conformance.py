"""The operator conformance suite behind :func:`pipeline.testing.check_operator`.

Each rule is checked by one small scenario: build a fresh operator, link it to a scripted
downstream, drive it the way a graph would (a full run, a consumer that stops early, a
downstream error, a kill, optionally a lost worker and a retry) and say which rule broke.

Three properties make the suite usable on operators that are badly broken, which is what
it is for:

* **Every violation names its rule.** A broken operator usually fails with a raw runtime
  error far from its cause ("async generator ignored GeneratorExit", a cancel scope exited
  in the wrong task, "Nursery misnesting detected!"); those are translated into a
  :class:`ConformanceError` that says which rule the operator broke and how to fix it.
* **Checks are isolated.** Each scenario runs in a task of its own, so an operator that
  corrupts its task's cancel-scope stack (a task group held open across a ``yield``)
  cannot make the next check, or the caller's next ``await``, fail with a stray
  cancellation.
* **No check waits past its deadline on anything the suite controls.** A watchdog task
  kills every Context the suite created when the time limit passes. A kill cancels the
  stream and also ends every wait of the scripted downstream (it waits on the Context),
  so an operator that drains its downstream inside a shielded cancel scope is released
  and the check reports the timeout. What no code on the same event loop can interrupt is
  an operator that shields a wait on something else entirely, or that catches every
  cancellation and loops: structured concurrency gives nobody the right to abandon a task.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from anyio.lowlevel import checkpoint

from ._operator_checks import (
    CHECKS,
    END_WHEN_CLOSED,
    NO_SCOPE_ACROSS_YIELD,
    OWN_TASK,
    RETRY_CHECK,
    Check,
    Scenario,
    Violation,
)
from .context import Context
from .operator import Operator

__all__ = ("CheckTimeout", "ConformanceError", "check_operator")

#: Streams of failed checks that would not close (see :func:`_finalize`): kept so that
#: they are never garbage-collected in the middle of another test.
_FAILED_STREAMS: list[object] = []
#: how many outputs :func:`_end` takes from a stream that refused to close
_CLOSE_ATTEMPTS = 10_000
#: how long (seconds) :func:`_finalize` lets each such stream run on to its end
_CLOSE_TIME = 1.0

NO_TASK_BEHIND = "leave no task behind"
RESPOND_TO_CANCELLATION = "respond to cancellation promptly"
NO_UNEXPECTED_ERRORS = "raise only what downstream raised"


class ConformanceError(AssertionError):
    """An operator broke a rule of the operator contract.

    The message starts with the operator's name and ends with the rule, e.g. ``"Upper:
    swallowed the downstream error ... [rule: let downstream errors through unchanged]"``.
    """

    def __init__(self, operator: str, rule: str, message: str) -> None:
        super().__init__(f"{operator}: {message} [rule: {rule}]")
        #: the name of the operator (its factory's ``__name__``)
        self.operator = operator
        #: the rule broken, as named in :func:`check_operator`'s docstring
        self.rule = rule


class CheckTimeout(ConformanceError, TimeoutError):
    """A check did not finish within ``check_operator``'s time limit (a TimeoutError too)."""


async def check_operator(
    factory: Callable[[], Operator[Any, Any, Any, Any]],
    request: Any,
    downstream_outputs: Sequence[Any],
    *,
    time_limit: float = 5.0,
    retry: bool = False,
    before_attempt: Callable[[Context[Any]], object] | None = None,
) -> None:
    """Check that operators built by ``factory()`` keep the operator contract.

    Each check builds a new operator, links it to a :class:`~pipeline.testing.ScriptedEngine`
    that plays ``downstream_outputs`` and sends it ``request``. The operator must:

    1. call downstream, passing a context with the caller's id;
    2. close the downstream stream when its own consumer stops early (after the first
       output, or once downstream has nothing more to give), in the consumer's task;
    3. end when its own stream is closed: no yield and no new downstream call after
       ``aclose()`` (catch ``Exception``, never ``BaseException``);
    4. let a downstream exception through unchanged (the same object);
    5. end promptly after ``kill()`` while downstream hangs, yielding nothing more and
       letting the cancellation through;
    6. hold no task group or cancel scope open across a ``yield``;
    7. leave no task running behind it;
    8. respond to cancellation: no wait on downstream inside a shielded scope.

    With ``retry=True`` it also checks that the operator survives a retry the way
    Migration drives one: downstream is lost (:class:`~pipeline.StreamDisconnected`) after
    each prefix of ``downstream_outputs``, a new operator from ``factory()`` is called
    again with a child of the same request context, and downstream continues with the
    rest. What reaches the caller over both attempts must equal a run without the fault,
    which holds only when per-request state lives in ``ctx.state`` (a
    :class:`~pipeline.StateKey`), not in ``generate()``'s locals or on the operator.
    ``before_attempt(ctx)`` is called on the request's context before every attempt, to
    do what the retrying operator upstream does (for the Backend behind Migration:
    ``ctx.state.set(RESUMABLE, True)``).

    ``retry=True`` is for operators that sit *below* a retrying operator, which calls them
    again for each attempt: in the LLM layer's default graph, below Migration (the Backend,
    the routers, and operators inserted before ``backend``, a router or the engine). An
    operator *above* it (the preprocessor, the parsers, operators inserted before
    ``parser`` or ``migration``, such as a redactor holding outputs while it decides)
    never sees a retry: its ``generate`` keeps running while the retrier retries below, so
    its locals survive and it may keep state there. Check such an operator without
    ``retry=True``; with it, it fails for a retry that cannot reach it.

    Raises:
        ConformanceError: an ``AssertionError`` naming the first rule broken (``.rule``).
        CheckTimeout: also a ``TimeoutError``, when the checks together take longer than
            ``time_limit`` seconds.
    """
    if before_attempt is not None and not retry:
        raise ValueError("before_attempt is only used by the retry check: pass retry=True")
    if retry and not downstream_outputs:
        raise ValueError("the retry check needs at least one downstream output to lose")
    name = getattr(factory, "__name__", repr(factory))
    deadline = anyio.current_time() + time_limit
    before = _task_ids()
    for check in (*CHECKS, RETRY_CHECK) if retry else CHECKS:
        scenario = Scenario(name, factory, request, downstream_outputs, before_attempt)
        failure = await _run_isolated(check, scenario, deadline, time_limit)
        if failure is not None:
            raise failure
    await _settle()
    leftover = _task_ids() - before
    if leftover:
        raise ConformanceError(
            name,
            NO_TASK_BEHIND,
            f"left {len(leftover)} task(s) running; every task an operator starts "
            "must finish before its generate() yields or returns",
        )


@dataclass
class _Outcome:
    failure: ConformanceError | None = None
    state: Literal["running", "done", "expired"] = "running"


async def _run_isolated(
    check: Check, scenario: Scenario, deadline: float, time_limit: float
) -> ConformanceError | None:
    """Run one check in a task of its own, under a watchdog that fires at ``deadline``.

    The task keeps whatever a broken operator does to its cancel-scope stack away from the
    caller's task and the next check.
    """
    outcome = _Outcome()
    try:
        async with anyio.create_task_group() as tg:

            async def watchdog() -> None:
                await anyio.sleep_until(deadline)
                if outcome.state == "running":
                    outcome.state = "expired"
                for ctx in scenario.contexts:
                    ctx.kill()  # ends the scripted downstream's waits, even inside a shield

            async def body() -> None:
                try:
                    outcome.failure = await _failure_of(check, scenario, deadline)
                finally:
                    if outcome.state == "running":
                        outcome.state = "done"
                    tg.cancel_scope.cancel()  # the watchdog has nothing left to do

            tg.start_soon(watchdog)
            tg.start_soon(body)
    except Exception as exc:
        # The check's own task could not end: the operator left a cancel scope of its own
        # on that task's stack (anyio reports it as the task exits). The report from
        # inside the check, when it has one, says more.
        if outcome.failure is None or outcome.failure.rule == NO_UNEXPECTED_ERRORS:
            rule, message = _diagnose(exc, check.title)
            outcome.failure = ConformanceError(scenario.name, rule, message)
            outcome.failure.__cause__ = exc
    if outcome.state == "expired" or outcome.failure is not None:
        await _finalize(scenario.streams)
    if outcome.state == "expired":
        timeout = CheckTimeout(
            scenario.name,
            RESPOND_TO_CANCELLATION,
            f"the {check.title!r} check ran over check_operator's {time_limit:g}s limit; "
            "the operator does not respond to cancellation promptly (never wait on "
            "downstream inside a shielded CancelScope)",
        )
        timeout.__cause__ = outcome.failure
        return timeout
    return outcome.failure


async def _failure_of(check: Check, scenario: Scenario, deadline: float) -> ConformanceError | None:
    """Run ``check``; what it raised (other than cancellation) as a ConformanceError."""
    name = scenario.name
    try:
        with anyio.CancelScope(deadline=deadline):
            await check.run(scenario)
    except Violation as exc:
        error = ConformanceError(name, exc.rule, exc.message)
        error.__cause__ = exc.__cause__
        return error
    except Exception as exc:
        rule, message = _diagnose(exc, check.title)
        error = ConformanceError(name, rule, message)
        error.__cause__ = exc
        return error
    return None


def _diagnose(exc: BaseException, title: str) -> tuple[str, str]:
    """Name the rule behind a raw runtime error that a broken operator provoked."""
    for leaf in _leaves(exc):
        text = str(leaf)
        if isinstance(leaf, RuntimeError) and "ignored GeneratorExit" in text:
            return END_WHEN_CLOSED, (
                "yielded again after its stream was closed (it caught GeneratorExit); "
                "catch Exception, never BaseException, and let GeneratorExit and "
                "cancellation through"
            )
        if "already running" in text:
            return OWN_TASK, (
                "the consumer stopped early but the downstream stream could not be "
                "closed because another task is iterating it; iterate downstream in the "
                "operator's own generate(), not in a task that outlives it"
            )
        if "cancel scope" in text.lower() or "misnesting" in text.lower():
            return NO_SCOPE_ACROSS_YIELD, (
                f"yielded inside a task group or cancel scope ({type(leaf).__name__}: "
                f"{text}); finish every task group before the next yield, e.g. prefetch "
                "by iterating downstream in generate() itself"
            )
    return NO_UNEXPECTED_ERRORS, f"raised {exc!r} in the {title!r} check"


def _leaves(exc: BaseException, seen: set[int] | None = None) -> Iterator[BaseException]:
    """``exc``, the members of exception groups, and what each was raised while handling."""
    seen = set() if seen is None else seen
    if id(exc) in seen:
        return
    seen.add(id(exc))
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner, seen)
    else:
        yield exc
    if exc.__context__ is not None:
        yield from _leaves(exc.__context__, seen)


async def _finalize(streams: list[object]) -> None:
    """End a failed check's streams here, on the check's own event loop.

    Left to the garbage collector, an operator that refused to close would be finalized
    later without its loop (at interpreter exit, after pytest's summary) and Python would
    print "Exception ignored in ..." for it, which reads as a failure. Each stream gets
    a bounded time to end; one that does not is kept alive, and silent, in
    :data:`_FAILED_STREAMS`.
    """
    with anyio.CancelScope(shield=True):
        for stream in streams:
            ended = False
            with anyio.move_on_after(_CLOSE_TIME):
                ended = await _end(stream)
            if not ended:
                _FAILED_STREAMS.append(stream)


async def _end(stream: Any) -> bool:
    """Close ``stream``; True once it has ended.

    An async generator that caught GeneratorExit and yielded is marked closed yet still
    suspended at its yield, and every later ``aclose()`` returns at once without running
    it (CPython raises StopAsyncIteration). Iterating it still resumes it, so it is run
    on to its end instead, as a bounded number of steps.
    """
    try:
        await stream.aclose()
    except Exception:  # "ignored GeneratorExit": the generator is still suspended
        pass
    else:
        return True
    for _ in range(_CLOSE_ATTEMPTS):
        try:
            await stream.__anext__()
        except StopAsyncIteration:
            break
        except Exception:  # it ended by raising: ended all the same
            break
    else:
        return False
    with contextlib.suppress(Exception):
        await stream.aclose()  # what it opened downstream (a linked stream's record)
    return True


async def _settle() -> None:
    for _ in range(3):
        await checkpoint()


def _task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}
