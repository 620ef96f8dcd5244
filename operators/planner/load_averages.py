"""The workers' load over an interval: :class:`LoadAverages`.

A worker reports its load when it changes (:class:`pipeline.transports.nats.NatsLoads`):
a step function of time, known at each report. The planner wants the load averaged over
its interval, not the value at the instant it decides (a burst that ended a moment ago, a
queue that is about to form), so it integrates each reported number over time and
:meth:`~LoadAverages.take` hands out the averages since the last take. Sans-IO: callers
pass the time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, final

__all__ = ("LoadAverages",)


@final
class _Track:
    """One worker's reports: the last one, and the integral since ``since``."""

    __slots__ = ("at", "integral", "last", "since")

    def __init__(self, load: Mapping[str, float], now: float) -> None:
        self.last = dict(load)
        self.at = now
        self.since = now
        self.integral: dict[str, float] = {}

    def advance(self, now: float) -> None:
        elapsed = max(now - self.at, 0.0)
        for name, value in self.last.items():
            self.integral[name] = self.integral.get(name, 0.0) + value * elapsed
        self.at = max(now, self.at)


@final
class LoadAverages:
    """Each worker's reported numbers (``waiting``, ``decoding``, ``prefill``...), averaged
    over time."""

    __slots__ = ("_tracks",)

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}

    def report(self, worker_id: str, load: Mapping[str, Any], now: float) -> None:
        """``worker_id`` says its load is ``load`` from ``now`` on (non-numbers ignored)."""
        numbers = {
            name: float(value)
            for name, value in load.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        track = self._tracks.get(worker_id)
        if track is None:
            self._tracks[worker_id] = _Track(numbers, now)
            return
        track.advance(now)
        track.last = numbers

    def knows(self, worker_id: str) -> bool:
        """Whether ``worker_id`` has reported its load."""
        return worker_id in self._tracks

    def now(self, worker_id: str) -> Mapping[str, float]:
        """``worker_id``'s last report (empty: none)."""
        track = self._tracks.get(worker_id)
        return {} if track is None else track.last

    def forget(self, worker_id: str) -> None:
        """Drop ``worker_id`` (it left)."""
        self._tracks.pop(worker_id, None)

    def take(self, workers: Iterable[str], now: float) -> dict[str, float] | None:
        """The sum over ``workers`` of each number's average since the last take (since its
        first report, for a worker new since then), and start over; None when one of them
        has not reported yet (its load is unknown, not zero)."""
        tracks = []
        for worker_id in workers:
            track = self._tracks.get(worker_id)
            if track is None:
                return None
            tracks.append(track)
        total: dict[str, float] = {}
        for track in tracks:
            track.advance(now)
            span = now - track.since
            for name in track.integral.keys() | track.last.keys():
                value = (
                    track.integral.get(name, 0.0) / span if span > 0 else track.last.get(name, 0.0)
                )
                total[name] = total.get(name, 0.0) + value
            track.integral = {}
            track.since = now
        return total
