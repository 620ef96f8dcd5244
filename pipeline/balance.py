"""RecentShares: how many of the recent requests each worker received, for the KV router's
guard of idle capacity.

The KV router's cost may send a request to a busy worker holding its prefix rather than to
an idle one, when that is faster for the request. So that idle workers are still used (and
a hot prefix is replicated while they sit idle), the router passes over a busy worker that
received more than ``balance`` times the mean of the recent requests (plus one) while some
worker is idle. "Recent" is a count decayed at every decision over ``8 * workers`` decisions
(at least 32): it follows a change of load within a few dozen requests, it never needs a
clock, and tests can compute it from a log of decisions alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

__all__ = ("RecentShares",)


@final
class RecentShares:
    """Decayed counts of the requests sent to each worker, by id."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[str, float] = {}

    def __getitem__(self, worker: str) -> float:
        return self._counts.get(worker, 0.0)

    def limit(self, balance: float, workers: Sequence[str]) -> float:
        """The count a worker among ``workers`` must stay under: ``balance`` times their
        mean, plus one."""
        counts = self._counts
        return balance * sum(counts.get(w, 0.0) for w in workers) / len(workers) + 1

    def count(self, chosen: str, workers: int) -> None:
        """One more request to ``chosen``, every count decayed by ``1 - 1 / max(32, 8 *
        workers)`` first."""
        counts = self._counts
        decay = 1.0 - 1.0 / max(32, 8 * workers)
        for worker in list(counts):
            value = counts[worker] * decay
            if value < 1e-3:
                del counts[worker]
            else:
                counts[worker] = value
        counts[chosen] = counts.get(chosen, 0.0) + 1.0

    def __repr__(self) -> str:
        return f"RecentShares({ {w: round(c, 2) for w, c in self._counts.items()} })"
