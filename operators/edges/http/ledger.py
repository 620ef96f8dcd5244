"""Each key's usage by model and minute, kept for a day: :class:`UsageLedger`.

:mod:`.admission` records every request that reached it when it ends (its status, its
prompt, cached and output tokens); ``GET /v1/usage`` (:mod:`.usage`) reads it back.
"""

from __future__ import annotations

import datetime
import math
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final, final

import orjson

__all__ = ("RETENTION", "Tally", "UsageLedger")

#: how long the per-minute counts are kept (seconds)
RETENTION: Final = 24 * 3600.0


@dataclass(slots=True)
class Tally:
    """One key's use of one model over some minutes."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.output_tokens += other.output_tokens
        for status, count in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + count


@final
class UsageLedger:
    """Each key's use, by model and minute, for ``retention`` seconds (``clock``: the wall
    clock's seconds)."""

    __slots__ = ("_clock", "_minutes", "retention")

    def __init__(self, *, retention: float = RETENTION, clock: Callable[[], float] = time.time):
        self.retention = retention
        self._clock = clock
        #: (minute, {(key, model): tally}), oldest first
        self._minutes: deque[tuple[int, dict[tuple[str, str], Tally]]] = deque()

    def record(
        self,
        key: str,
        model: str,
        *,
        status: int,
        prompt: int = 0,
        cached: int = 0,
        output: int = 0,
    ) -> None:
        """Count one request of ``key`` on ``model`` that ended with ``status``."""
        minute = int(self._clock() // 60)
        minutes = self._minutes
        if not minutes or minutes[-1][0] != minute:
            minutes.append((minute, {}))
            oldest = minute - math.ceil(self.retention / 60)
            while minutes and minutes[0][0] < oldest:
                minutes.popleft()
        tallies = minutes[-1][1]
        tally = tallies.get((key, model))
        if tally is None:
            tally = tallies[key, model] = Tally()
        tally.requests += 1
        tally.prompt_tokens += prompt
        tally.cached_tokens += cached
        tally.output_tokens += output
        tally.statuses[status] = tally.statuses.get(status, 0) + 1

    def totals(
        self, since: float | None = None, keys: Collection[str] | None = None
    ) -> tuple[float, dict[tuple[str, str], Tally]]:
        """(the moment counted from, each (key, model)'s tally since then) for ``keys``
        (None: every key). ``since`` counts from the start of its minute, and from the
        retention's start at the earliest."""
        now = self._clock()
        earliest = (math.floor((now - self.retention) / 60) + 1) * 60
        start = earliest if since is None else max(earliest, math.floor(since / 60) * 60)
        first = int(start // 60)
        found: dict[tuple[str, str], Tally] = {}
        for minute, tallies in self._minutes:
            if minute < first:
                continue
            for (key, model), tally in tallies.items():
                if keys is not None and key not in keys:
                    continue
                total = found.get((key, model))
                if total is None:
                    total = found[key, model] = Tally()
                total.add(tally)
        return start, found

    def report(self, since: float | None = None, keys: Collection[str] | None = None) -> bytes:
        """``/v1/usage``'s answer (see the module's docstring)."""
        start, found = self.totals(since, keys)
        data = [
            {
                "key": key,
                "model": model,
                "requests": tally.requests,
                "statuses": {str(s): n for s, n in sorted(tally.statuses.items())},
                "prompt_tokens": tally.prompt_tokens,
                "cached_tokens": tally.cached_tokens,
                "output_tokens": tally.output_tokens,
                "total_tokens": tally.prompt_tokens + tally.output_tokens,
            }
            for (key, model), tally in sorted(found.items())
        ]
        return orjson.dumps(
            {"object": "usage", "since": _iso(start), "until": _iso(self._clock()), "data": data}
        )


def _iso(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(int(seconds), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
