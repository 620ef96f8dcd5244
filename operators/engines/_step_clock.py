"""The mocker's step clock: when each simulated engine step starts and ends.

Apart from :class:`~operators.engines.mocker.MockerEngine` because it is the one piece of
the mocker with arithmetic worth testing on its own, and it has no task of its own: every
sequence sleeps until the end of the step it waits for, and whichever wakes first launches
the next step.
"""

from __future__ import annotations

import math
from typing import final

import anyio
from anyio.lowlevel import checkpoint

__all__ = ("StepClock",)


@final
class StepClock:
    """One simulated accelerator's iteration clock. Sans-IO: callers pass the time.

    Step ``k`` starts when step ``k-1`` ends (or when work arrives at an idle clock) and
    lasts ``decode_s + prefill_s * <prompt tokens admitted into it> + sequence_s *
    <sequences registered when it starts>`` (a batch that grows makes every step longer,
    as on a real accelerator). A step is launched only while some registered sequence
    still needs it, so an idle clock stays idle.
    """

    __slots__ = (
        "_active",
        "_decode_s",
        "_horizon",
        "_last",
        "_pending",
        "_prefill_s",
        "_sequence_s",
        "end",
        "step",
    )

    def __init__(self, decode_s: float, prefill_s: float, sequence_s: float = 0.0) -> None:
        self._decode_s = decode_s
        self._prefill_s = prefill_s
        self._sequence_s = sequence_s
        self._active = 0  # sequences registered
        #: steps launched so far; step ``step`` ends (or ended) at ``end``
        self.step = 0
        self.end = -math.inf
        self._pending = 0  # prompt tokens admitted into the next step
        self._last: dict[int, int] = {}  # last step a sequence needs -> how many sequences
        self._horizon = 0  # the latest step any sequence needs

    def advance(self, now: float) -> None:
        """Launch every step whose start time has come and that someone needs."""
        while self.end <= now and self._horizon > self.step:
            self.step += 1
            self.end += (
                self._decode_s + self._pending * self._prefill_s + self._active * self._sequence_s
            )
            self._pending = 0

    def join(self, now: float, prefill_tokens: int, steps: int) -> tuple[int, int]:
        """Register a sequence needing ``steps`` steps, the first carrying its prefill.

        Returns its first and last step.
        """
        self.advance(now)
        if self.end <= now:  # idle: the next step starts now
            self.end = now
        first = self.step + 1
        last = first + steps - 1
        self._pending += prefill_tokens
        self._active += 1
        self._last[last] = self._last.get(last, 0) + 1
        self._horizon = max(self._horizon, last)
        return first, last

    def leave(self, now: float, first: int, last: int, prefill_tokens: int) -> None:
        """Unregister a sequence (finished, stopped, failed or cancelled)."""
        if self.step < first:  # left before its prefill was run
            self._pending -= prefill_tokens
        self._active -= 1
        remaining = self._last[last] - 1
        if remaining:
            self._last[last] = remaining
        else:
            del self._last[last]
            if last == self._horizon:
                self._horizon = max(self._last, default=0)
                if self._horizon < self.step and self.end > now:
                    self.end = now  # nobody waits for the running step: abort it

    async def wait_step(self, step: int) -> None:
        """Sleep until step ``step`` has ended (at once if it already has)."""
        slept = False
        while True:
            now = anyio.current_time()
            self.advance(now)
            if self.step > step or (self.step == step and self.end <= now):
                break
            await anyio.sleep(self.end - now)
            slept = True
        if not slept:
            await checkpoint()  # every step is a checkpoint, even a zero-length one
