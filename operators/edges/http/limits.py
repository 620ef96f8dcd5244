"""A key's rate limits as arithmetic: what a request may take, and when a refused one may
come back. No clock, no I/O, no state of its own: :mod:`.budgets` (one frontend) and
:mod:`.nats_budgets` (every frontend, in a JetStream KV bucket) keep the state and call
these with the time.

A limit of ``L`` per minute is a bucket of ``L`` units refilled continuously, ``L / 60``
per second: a key may burst its whole minute at once, and a refused request knows to the
millisecond when it fits (its ``Retry-After``), instead of waiting for a window to roll
over. A :class:`Meter` holds what is used, not a point in time, so a reload that changes
the limit keeps what a key has used, and two frontends with the same state agree::

    used(now) = max(0, used - (now - at) * L / 60)           what still counts
    take n:     used(now) + n <= L, else wait (used(now) + n - L) * 60 / L seconds
                (n > L never fits: the request is too large for the limit)
    settle:     used(now) + (actual - reserved), at least 0  (unused tokens go back)

Requests count 1 each; tokens are reserved at admission (the prompt and what the request
may generate) and settled to the real count when it ends, which may leave a key in debt
(``used > L``: a request that generated more than was reserved) until the bucket refills.
A key's ``max_inflight`` is a count, not a rate: taken at admission, given back at the end.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, replace
from typing import Final, Literal

__all__ = (
    "MINUTE",
    "Ask",
    "Budget",
    "Limit",
    "Limits",
    "Meter",
    "Rates",
    "Standing",
    "Verdict",
    "admit",
    "duration",
    "release",
    "rfc3339",
    "standing",
    "used_at",
)

#: the period every limit is stated for, in seconds
MINUTE: Final = 60.0
#: what a request refused by its key's ``max_inflight`` is told to wait (nobody knows when
#: one of the key's requests ends)
_INFLIGHT_RETRY: Final = 1.0

Limit = Literal["requests", "tokens", "inflight"]
"""Which limit refused a request."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits (None: unlimited)."""

    requests_per_minute: int | None = None
    #: prompt and output tokens together
    tokens_per_minute: int | None = None
    #: requests of the key running at once
    max_inflight: int | None = None

    @property
    def any(self) -> bool:
        """Whether any limit is set."""
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or self.max_inflight is not None
        )

    def share(self, parts: int) -> Limits:
        """Each of ``parts`` frontends' share of these limits, when they cannot agree on
        one state (the shared store is unreachable): ``limit / parts``, at least 1."""
        if parts <= 1:
            return self

        def part(limit: int | None) -> int | None:
            return None if limit is None else max(1, limit // parts)

        return Limits(
            part(self.requests_per_minute), part(self.tokens_per_minute), part(self.max_inflight)
        )


@dataclass(frozen=True, slots=True)
class Meter:
    """Units used of one per-minute limit, as of ``at`` (seconds, wall clock)."""

    used: float = 0.0
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Budget:
    """What one key has used: of each per-minute limit, and requests running now."""

    requests: Meter = Meter()
    tokens: Meter = Meter()
    inflight: int = 0


@dataclass(frozen=True, slots=True)
class Ask:
    """What an admission takes (or a settlement gives back, negated)."""

    requests: int = 0
    tokens: int = 0
    inflight: int = 0


@dataclass(frozen=True, slots=True)
class Standing:
    """One per-minute limit as a client is told it (``x-ratelimit-*``)."""

    limit: int
    #: units left now (0 when in debt)
    remaining: int
    #: seconds until the bucket is full again
    reset: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """An admission's answer."""

    admitted: bool
    #: the limit that refused it (None: admitted)
    refused_by: Limit | None = None
    #: seconds until the same ask would be admitted (0: admitted; None: never, the ask
    #: is larger than the limit)
    retry_after: float | None = 0.0
    requests: Standing | None = None
    tokens: Standing | None = None


def used_at(meter: Meter, limit: int, now: float) -> float:
    """The units of ``meter`` still counted at ``now`` under a limit of ``limit`` a minute
    (a clock that went back refills nothing)."""
    if now <= meter.at:
        return meter.used
    return max(0.0, meter.used - (now - meter.at) * limit / MINUTE)


def _wait(used: float, amount: int, limit: int) -> float | None:
    """Seconds until ``amount`` more fits under ``limit`` (None: never)."""
    if amount > limit:
        return None
    excess = used + amount - limit
    return 0.0 if excess <= 0 else excess * MINUTE / limit


def _standing(used: float, limit: int) -> Standing:
    return Standing(limit, max(0, math.floor(limit - used)), used * MINUTE / limit)


def standing(budget: Budget, limits: Limits, now: float) -> tuple[Standing | None, Standing | None]:
    """(requests, tokens) as a client is told them (None: that limit is not set)."""
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    return (
        None if rpm is None else _standing(used_at(budget.requests, rpm, now), rpm),
        None if tpm is None else _standing(used_at(budget.tokens, tpm, now), tpm),
    )


def admit(budget: Budget, limits: Limits, ask: Ask, now: float) -> tuple[Budget, Verdict]:
    """Take ``ask`` from ``budget`` if every limit allows it: (the budget after, the verdict).

    A refused ask leaves the budget as it was; its ``retry_after`` is the longest of the
    waits the refusing limits need (None when one never will: the ask is over the limit).
    """
    rpm, tpm, most = limits.requests_per_minute, limits.tokens_per_minute, limits.max_inflight
    requests_used = 0.0 if rpm is None else used_at(budget.requests, rpm, now)
    tokens_used = 0.0 if tpm is None else used_at(budget.tokens, tpm, now)
    refusals: list[tuple[Limit, float | None]] = []
    if most is not None and ask.inflight and budget.inflight + ask.inflight > most:
        refusals.append(("inflight", _INFLIGHT_RETRY))
    if rpm is not None and ask.requests > 0:
        needed = _wait(requests_used, ask.requests, rpm)
        if needed != 0.0:
            refusals.append(("requests", needed))
    if tpm is not None and ask.tokens > 0:
        needed = _wait(tokens_used, ask.tokens, tpm)
        if needed != 0.0:
            refusals.append(("tokens", needed))
    if refusals:
        never = [kind for kind, wait in refusals if wait is None]
        if never:
            refused_by, longest = never[0], None
        else:
            refused_by, longest = max(refusals, key=lambda refusal: refusal[1] or 0.0)
        return budget, Verdict(
            False,
            refused_by,
            longest,
            None if rpm is None else _standing(requests_used, rpm),
            None if tpm is None else _standing(tokens_used, tpm),
        )
    if rpm is not None:
        requests_used += ask.requests
    if tpm is not None:
        tokens_used += ask.tokens
    after = Budget(
        Meter(requests_used, now) if rpm is not None else budget.requests,
        Meter(tokens_used, now) if tpm is not None else budget.tokens,
        budget.inflight + ask.inflight,
    )
    return after, Verdict(
        True,
        requests=None if rpm is None else _standing(requests_used, rpm),
        tokens=None if tpm is None else _standing(tokens_used, tpm),
    )


def release(budget: Budget, limits: Limits, back: Ask, now: float) -> Budget:
    """Give ``back`` to ``budget``, no questions asked: a refund, or a settlement (a
    negative ``tokens`` charges what a request used beyond its reservation). Nothing goes
    below zero."""
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    requests, tokens = budget.requests, budget.tokens
    if rpm is not None and back.requests:
        requests = Meter(max(0.0, used_at(requests, rpm, now) - back.requests), now)
    if tpm is not None and back.tokens:
        tokens = Meter(max(0.0, used_at(tokens, tpm, now) - back.tokens), now)
    return replace(
        budget, requests=requests, tokens=tokens, inflight=max(0, budget.inflight - back.inflight)
    )


# ----------------------------------------------------------------- how clients are told


@dataclass(frozen=True, slots=True)
class Rates:
    """A key's limits as a response tells them (each API in its own headers)."""

    requests: Standing | None = None
    tokens: Standing | None = None
    #: a refusal's exact wait, in seconds (0: not refused; None: never, too large)
    retry_after: float | None = 0.0
    #: the limit that refused the request (None: not refused)
    refused_by: Limit | None = None

    @property
    def any(self) -> bool:
        """Whether there is anything to tell."""
        return self.requests is not None or self.tokens is not None


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI's ``x-ratelimit-reset-*`` headers say it (Go's durations, to
    the millisecond): ``0s``, ``12ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    millis = max(0, math.ceil(seconds * 1000 - 1e-6))
    if millis == 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    secs = f"{whole}.{fraction:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def rfc3339(epoch: float) -> str:
    """A moment as Anthropic's ``anthropic-ratelimit-*-reset`` headers say it (RFC 3339,
    UTC, to the second, rounded up: the bucket is full by then)."""
    moment = datetime.datetime.fromtimestamp(math.ceil(epoch), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
