"""ScriptedEngine: a downstream that plays back a script (re-exported by pipeline.testing).

It is the downstream of every :func:`~pipeline.testing.check_operator` scenario, and it
waits only on its Context, so killing the Context ends every wait it makes: that is what
lets the conformance suite's watchdog end a check even through a shielded cancel scope.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Literal, TypeVar, final

import anyio
from anyio.lowlevel import checkpoint

from .context import Context
from .operator import Stream

__all__ = ("ScriptedEngine",)

Out = TypeVar("Out")


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
