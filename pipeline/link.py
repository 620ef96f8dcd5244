"""Composing operators onto an engine: :func:`link`.

``link(a, b, engine)`` is a right fold: the result is an Engine whose ``generate(ctx)`` is
``a.generate(ctx, <b linked to engine>)``. No task, queue or copy sits between stages; the
only thing a link adds is bookkeeping of the downstream streams an operator opened, so that
when the caller closes the stream early every generator down to the engine is closed too,
in order, in the caller's task, even if the operator's author never wrote ``aclosing``.
An operator that returns downstream's own stream (a passthrough) gets it back unwrapped.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from .errors import LinkError

if TYPE_CHECKING:
    from .context import Context
    from .operator import Engine, Operator

__all__ = ("link",)

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
E = TypeVar("E")
F = TypeVar("F")
G = TypeVar("G")
H = TypeVar("H")
I_ = TypeVar("I_")
J = TypeVar("J")


def _name(obj: object) -> str:
    return type(obj).__name__


def _positional_arity(method: Any) -> int | None:
    """How many positional arguments ``method`` takes, or None when it can't be told."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return None
    count = 0
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            count += 1
    return count


def _check_stage(stage: object, *, position: str, arity: int) -> None:
    if isinstance(stage, type):
        # A class has an (unbound) generate too, so say so before counting its parameters.
        raise LinkError(
            f"{position} is the class {stage.__name__}, not an instance of it; "
            f"did you mean {stage.__name__}()?"
        )
    generate = getattr(stage, "generate", None)
    if generate is None or not callable(generate):
        hint = ""
        if inspect.isasyncgenfunction(stage) or inspect.iscoroutinefunction(stage):
            hint = " It is a function; wrap it in pipeline.FunctionEngine(...) to use it."
        raise LinkError(f"{position} {stage!r} has no generate() method.{hint}")
    if inspect.iscoroutinefunction(generate):
        raise LinkError(
            f"{_name(stage)}.generate is a coroutine function (async def without yield); "
            "it must be an async generator. Did you forget to `yield`?"
        )
    found = _positional_arity(generate)
    if found is None or found == arity:
        return
    if arity == 1 and found == 2:
        raise LinkError(
            f"the last argument of link() must be an engine, but {_name(stage)}.generate "
            "takes (ctx, downstream) like an operator. Did you forget the engine?"
        )
    if arity == 2 and found == 1:
        raise LinkError(
            f"{position} {_name(stage)} looks like an engine (generate takes only ctx); "
            "only the last argument of link() may be an engine."
        )
    kind, params = ("engine", "(ctx)") if arity == 1 else ("operator", "(ctx, downstream)")
    raise LinkError(
        f"{_name(stage)}.generate takes {found} positional arguments; an {kind} takes {params}."
    )


def _as_stream(result: object, stage: object) -> AsyncIterator[Any]:
    if hasattr(result, "__anext__"):
        return cast("AsyncIterator[Any]", result)
    if inspect.iscoroutine(result):
        result.close()
        raise LinkError(
            f"{_name(stage)}.generate returned a coroutine, not an async iterator. "
            "Did you forget to `yield`?"
        )
    raise LinkError(
        f"{_name(stage)}.generate returned {type(result).__name__}, not an async iterator"
    )


class _Downstream:
    """What a linked operator sees as ``downstream``: records the streams it opens."""

    __slots__ = ("_engine", "opened")

    def __init__(self, engine: Engine[Any, Any]) -> None:
        self._engine = engine
        self.opened: list[AsyncIterator[Any]] = []

    def generate(self, ctx: Context[Any], /) -> AsyncIterator[Any]:
        stream = _as_stream(self._engine.generate(ctx), self._engine)
        self.opened.append(stream)
        return stream


class _LinkedStream:
    """The stream of one operator call; closing it closes what the operator opened."""

    __slots__ = ("_downstream", "_stream")

    def __init__(self, stream: AsyncIterator[Any], downstream: _Downstream) -> None:
        self._stream = stream
        self._downstream = downstream

    def __aiter__(self) -> _LinkedStream:
        return self

    def __anext__(self) -> Any:
        # Return the awaitable itself: no extra coroutine frame per item.
        return self._stream.__anext__()

    def athrow(self, *args: Any) -> Any:
        return self._stream.athrow(*args)  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        try:
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            for opened in self._downstream.opened:
                aclose = getattr(opened, "aclose", None)
                if aclose is not None:
                    await aclose()


class _Linked:
    """An operator bound to its downstream: itself an Engine."""

    __slots__ = ("_downstream", "_operator")

    def __init__(self, operator: Operator[Any, Any, Any, Any], downstream: Engine[Any, Any]):
        self._operator = operator
        self._downstream = downstream

    def generate(self, ctx: Context[Any], /) -> AsyncIterator[Any]:
        downstream = _Downstream(self._downstream)
        stream = _as_stream(self._operator.generate(ctx, downstream), self._operator)
        opened = downstream.opened
        if len(opened) == 1 and opened[0] is stream:
            # The operator handed downstream's stream through: closing it closes all the
            # operator opened, so there is nothing to record and no hop to add.
            return stream
        return _LinkedStream(stream, downstream)

    def __repr__(self) -> str:
        return f"link({self._operator!r}, {self._downstream!r})"


@overload
def link(engine: Engine[A, B], /) -> Engine[A, B]: ...
@overload
def link(op1: Operator[A, B, C, D], engine: Engine[C, D], /) -> Engine[A, B]: ...
@overload
def link(
    op1: Operator[A, B, C, D], op2: Operator[C, D, E, F], engine: Engine[E, F], /
) -> Engine[A, B]: ...
@overload
def link(
    op1: Operator[A, B, C, D],
    op2: Operator[C, D, E, F],
    op3: Operator[E, F, G, H],
    engine: Engine[G, H],
    /,
) -> Engine[A, B]: ...
@overload
def link(
    op1: Operator[A, B, C, D],
    op2: Operator[C, D, E, F],
    op3: Operator[E, F, G, H],
    op4: Operator[G, H, I_, J],
    engine: Engine[I_, J],
    /,
) -> Engine[A, B]: ...
@overload
def link(*stages: Any) -> Engine[Any, Any]: ...
def link(*stages: Any) -> Engine[Any, Any]:
    """Fold ``operators`` onto the engine given last; the result is an Engine.

    Raises:
        LinkError: when no engine is given, or a stage is not an operator or engine.
    """
    if not stages:
        raise LinkError("link() needs at least an engine")
    *operators, engine = stages
    _check_stage(engine, position="the engine", arity=1)
    for index, operator in enumerate(operators):
        _check_stage(operator, position=f"operator #{index + 1}", arity=2)
    linked: Engine[Any, Any] = engine
    for operator in reversed(operators):
        linked = _Linked(operator, linked)
    return linked
