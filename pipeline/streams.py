"""Driving a stream: :func:`open_stream`, and :class:`FunctionEngine` for quick engines.

The driver, not the operators, owns cancellation. ``open_stream`` enters one cancel scope
(bound to the context, so ``ctx.kill()`` and the deadline cancel it) and closes the stream
with ``aclose`` when the block exits, whether the consumer finished, broke out, raised or
was cancelled. That is why operators may be plain async generators: nothing in them holds
a scope across a ``yield``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Generic, TypeVar, final

import anyio

from .link import _as_stream

if TYPE_CHECKING:
    from .context import Context
    from .operator import Engine, Stream

__all__ = ("FunctionEngine", "open_stream")

In = TypeVar("In")
Out = TypeVar("Out")


@asynccontextmanager
async def open_stream(engine: Engine[In, Out], ctx: Context[In]) -> AsyncGenerator[Stream[Out]]:
    """Open ``engine``'s stream for ``ctx`` under the context's cancellation.

    Use it as ``async with open_stream(engine, ctx) as stream: async for item in stream``.
    When ``ctx`` is killed or its deadline passes, the block is cancelled and exits quietly
    (check ``ctx.is_killed``); when it (or a leg of it) is failed (``ctx.fail(error)``) the
    block is cancelled and raises ``error``; every other exception propagates unchanged.
    """
    deadline = ctx.deadline
    with anyio.CancelScope(deadline=math.inf if deadline is None else deadline) as scope:
        ctx._bind_scope(scope)
        try:
            stream = _as_stream(engine.generate(ctx), engine)
            try:
                yield stream
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        finally:
            ctx._unbind_scope(scope)
    if scope.cancelled_caught:
        failure = ctx._failure()
        if failure is not None:  # ctx.fail(): the stream ends with the error it was given
            raise failure
    if scope.cancelled_caught and not ctx.is_killed:
        # The deadline passed: that is a kill, so children and remote legs hear of it.
        ctx.kill()


@final
class FunctionEngine(Generic[In, Out]):
    """An Engine made from an async generator function ``fn(ctx)``.

    Handy for examples and tests: ``FunctionEngine(count_to_three)``.
    """

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[Context[In]], Stream[Out]]) -> None:
        self._fn = fn

    def generate(self, ctx: Context[In], /) -> Stream[Out]:
        """Call the wrapped function."""
        return self._fn(ctx)

    def __repr__(self) -> str:
        return f"FunctionEngine({getattr(self._fn, '__qualname__', self._fn)!r})"
