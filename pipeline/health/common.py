"""What :class:`~.supervised.Supervised` is made of besides its judging: the words (its
states, what a probe is), the timings, the restart budget, and closing a dead engine."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, final

import anyio

from pipeline.context import StateKey

if TYPE_CHECKING:
    from pipeline.context import Context
    from pipeline.operator import Engine

__all__ = (
    "CLOSE_TIMEOUT",
    "PROBE_RETRY",
    "PROBE_TIMEOUT",
    "RETRY_AFTER",
    "EngineState",
    "Probe",
    "RestartBudget",
    "close_engine",
    "lost_to",
    "mark_lost",
)

logger = logging.getLogger("pipeline.health")

EngineState = Literal["starting", "ready", "stalled", "failing", "restarting", "dead"]
"""Where a supervised engine is: ``starting`` (its first engine is being built),
``ready``, ``stalled`` (no progress with requests waiting), ``failing`` (a probe or canary
failed), ``restarting`` (it died and is being rebuilt), ``dead`` (beyond recovery)."""

Probe = Callable[["Engine[Any, Any]"], Awaitable[object]]
"""Sends one small request to the engine it is given and returns once it was answered
(raises if it was not): the canary, and the test of a stalled or rebuilt engine."""

#: seconds between probes of an engine that is not ready
PROBE_RETRY: Final = 1.0
#: how long a probe may take when there is no stall timeout to end it
PROBE_TIMEOUT: Final = 30.0
#: how long closing a dead engine may take before its rebuild goes on regardless
CLOSE_TIMEOUT: Final = 30.0
#: what a refused client is told to wait (``Retry-After``), seconds
RETRY_AFTER: Final = 5

#: the engines (by id) a request was already lost to: it does not wait for their restart
_LOST_TO: Final = StateKey[frozenset[int]]("pipeline.health.lost_to")


def mark_lost(ctx: Context[Any], engine: object) -> None:
    """``ctx``'s request was lost to ``engine`` (it stalled or died under it)."""
    ctx.state.set(_LOST_TO, ctx.state.get(_LOST_TO, frozenset()) | {id(engine)})


def lost_to(ctx: Context[Any], engine: object) -> bool:
    """Whether ``ctx``'s request was lost to ``engine`` already (a retry of it)."""
    return id(engine) in ctx.state.get(_LOST_TO, frozenset())


@final
class RestartBudget:
    """At most ``restarts`` rebuilds within any ``window`` seconds."""

    __slots__ = ("_times", "restarts", "spent", "window")

    def __init__(self, restarts: int, window: float) -> None:
        if restarts < 0 or not window > 0:
            raise ValueError("restarts must be >= 0 and restart_window > 0")
        self.restarts = restarts
        self.window = window
        #: rebuilds started, ever
        self.spent = 0
        self._times: deque[float] = deque()

    def spend(self, now: float) -> str | None:
        """Count one more rebuild at ``now``; None when the budget allows it, else why not."""
        times = self._times
        while times and now - times[0] >= self.window:
            times.popleft()
        if len(times) >= self.restarts:
            return f"{len(times)} restarts within {self.window:g} s already"
        times.append(now)
        self.spent += 1
        return None

    @property
    def recent(self) -> Sequence[float]:
        """When the rebuilds still within the window started."""
        return tuple(self._times)


async def close_engine(engine: object, name: str) -> None:
    """Close ``engine`` if it can be; a failure is logged (a dead engine may not close)."""
    aclose = getattr(engine, "aclose", None)
    if aclose is None:
        return
    with anyio.move_on_after(CLOSE_TIMEOUT) as late:
        try:
            await aclose()
        except Exception:
            logger.warning("%s: closing the dead engine failed", name, exc_info=True)
    if late.cancelled_caught:
        logger.warning("%s: the dead engine did not close within %g s", name, CLOSE_TIMEOUT)
