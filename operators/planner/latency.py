"""The frontends' latencies, for the planner: histogram deltas and their quantiles.

A frontend already keeps a histogram of each model's time to first token and inter-token
latency (``/metrics``: :class:`~operators.edges.http.metrics.ServerMetrics`), counted on
the request path. :class:`LatencyReporter` adds nothing there: every ``interval`` seconds
it compares the buckets with what it last sent and publishes the difference, only for the
models that measured something (an idle frontend publishes nothing). Differences from any
number of frontends add up in a :class:`Latencies`, whose :meth:`~Latencies.quantile`
interpolates linearly within a bucket, as Prometheus's ``histogram_quantile`` does: so the
resolution is the buckets' (about 1.33x apart around usual targets).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final, final

import anyio

from .wire import Bucket, Summary, encode_summary, latency_subject

if TYPE_CHECKING:
    from nats.aio.client import Client

    from operators.edges.http.metrics import HistogramFamily, ServerMetrics

__all__ = (
    "MIN_SAMPLES",
    "SUMMARY_INTERVAL",
    "Latencies",
    "LatencyReporter",
    "LatencyWindows",
    "delta",
)

logger = logging.getLogger(__name__)

#: seconds between two summaries of a frontend (when it measured something)
SUMMARY_INTERVAL: Final = 2.0
#: latencies below which a p90 is no verdict (they are kept for the next round)
MIN_SAMPLES: Final = 10
#: rounds latencies are kept waiting for enough of them (then dropped: too old to judge)
_CARRY: Final = 5


def delta(bounds: tuple[float, ...], before: tuple[int, ...], now: tuple[int, ...]) -> list[Bucket]:
    """The buckets that gained observations from ``before`` to ``now`` (per-bucket counts,
    the last one the +Inf bucket's), with their bounds."""
    found: list[Bucket] = []
    lower = 0.0
    for index, count in enumerate(now):
        upper = bounds[index] if index < len(bounds) else None
        gained = count - (before[index] if index < len(before) else 0)
        if gained > 0:
            found.append((lower, upper, gained))
        if upper is not None:
            lower = upper
    return found


@final
class Latencies:
    """One latency's observations over some time, from any number of histograms' deltas."""

    __slots__ = ("_counts",)

    def __init__(self, buckets: Iterable[Bucket] = ()) -> None:
        self._counts: dict[tuple[float, float], int] = {}
        self.add(buckets)

    def add(self, buckets: Iterable[Bucket]) -> None:
        """Count these buckets' observations too."""
        counts = self._counts
        for lower, upper, count in buckets:
            key = (lower, math.inf if upper is None else upper)
            counts[key] = counts.get(key, 0) + count

    @property
    def count(self) -> int:
        """How many observations."""
        return sum(self._counts.values())

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q <= 1), interpolated within its bucket; None without an
        observation. One in the +Inf bucket is its lower bound, as Prometheus has it."""
        total = self.count
        if not total:
            return None
        rank = q * total
        seen = 0
        for (lower, upper), count in sorted(self._counts.items(), key=lambda kv: kv[0][1]):
            if seen + count >= rank:
                if upper == math.inf:
                    return lower
                return lower + (upper - lower) * (rank - seen) / count
            seen += count
        return max(lower for lower, _ in self._counts)  # (rounding: q * total past the sum)

    def __repr__(self) -> str:
        return f"Latencies(count={self.count}, p90={self.quantile(0.9)})"


@final
class LatencyWindows:
    """What the frontends measured since it was last judged, by model and kind (``ttft``,
    ``itl``): a round judges each latency of which there are at least
    :data:`MIN_SAMPLES` (and starts it over), and keeps the others for the next round
    (a quiet model's few requests add up), at most five rounds."""

    __slots__ = ("_windows",)

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], tuple[Latencies, int]] = {}

    def add(self, model: str, kind: str, buckets: Iterable[Bucket]) -> None:
        """Count these observations of ``model``'s ``kind`` latency."""
        key = (model, kind)
        if key not in self._windows:
            self._windows[key] = (Latencies(), 0)
        self._windows[key][0].add(buckets)

    def judge(self) -> dict[str, dict[str, float]]:
        """The p90 of each latency with enough observations, by model and kind; one round
        older for the others."""
        judged: dict[str, dict[str, float]] = {}
        for key, (latencies, rounds) in list(self._windows.items()):
            p90 = latencies.quantile(0.9) if latencies.count >= MIN_SAMPLES else None
            if p90 is not None:
                judged.setdefault(key[0], {})[key[1]] = p90
                del self._windows[key]
            elif rounds + 1 >= _CARRY:
                del self._windows[key]
            else:
                self._windows[key] = (latencies, rounds + 1)
        return judged


@final
class LatencyReporter:
    """Publishes what ``metrics``' TTFT and ITL histograms gained, every ``interval``
    seconds, on the planner's latency subject (see :mod:`.wire`)."""

    def __init__(
        self,
        nc: Client,
        metrics: ServerMetrics,
        *,
        namespace: str,
        frontend: str,
        interval: float = SUMMARY_INTERVAL,
    ) -> None:
        self._nc = nc
        self._families = {"ttft": metrics.time_to_first_token, "itl": metrics.inter_token_latency}
        self._subject = latency_subject(namespace)
        self._frontend = frontend
        self._interval = interval
        self._sent: dict[tuple[str, str], tuple[int, ...]] = {}
        #: summaries published
        self.published = 0

    def summary(self) -> Summary:
        """What was measured since the last call, by model (empty: nothing)."""
        found: dict[str, dict[str, list[Bucket]]] = {}
        for kind, family in self._families.items():
            for model, buckets in self._gained(kind, family).items():
                found.setdefault(model, {})[kind] = buckets
        return found

    def _gained(self, kind: str, family: HistogramFamily) -> Mapping[str, list[Bucket]]:
        gained: dict[str, list[Bucket]] = {}
        for model, histogram in family.children().items():
            counts = histogram.counts
            before = self._sent.get((kind, model), ())
            if counts == before:
                continue
            self._sent[(kind, model)] = counts
            buckets = delta(histogram.bounds, before, counts)
            if buckets and model:  # ("": requests that named no served model)
                gained[model] = buckets
        return gained

    async def run(self) -> None:
        """Publish until cancelled."""
        self.summary()  # what was measured before: not this interval's
        while True:
            await anyio.sleep(self._interval)
            summary = self.summary()
            if not summary:
                continue
            try:
                await self._nc.publish(self._subject, encode_summary(self._frontend, summary))
            except Exception as exc:  # nats-py's errors: a connection closing or down
                logger.debug("latency summary not sent: %r", exc)
            else:
                self.published += 1

    def __repr__(self) -> str:
        return f"LatencyReporter({self._frontend!r}, {self._subject!r})"
