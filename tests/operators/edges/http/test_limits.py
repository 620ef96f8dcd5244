"""The bucket arithmetic of a key's limits (``operators.edges.http.limits``), as properties:
what is admitted over any stretch of time stays within the limit, a refusal's wait is
exact, what is given back is there again, and clients are told it in their formats."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.edges.http.limits import (
    MINUTE,
    Ask,
    Budget,
    Limits,
    Meter,
    admit,
    duration,
    release,
    rfc3339,
    standing,
    used_at,
)

LIMITS = st.integers(min_value=1, max_value=10_000)
#: (seconds since the previous ask, tokens asked, tokens actually used of them)
STEPS = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=30, allow_nan=False),
        st.integers(min_value=1, max_value=12_000),
        st.floats(min_value=0, max_value=1),
    ),
    max_size=60,
)


@given(limit=LIMITS, steps=STEPS)
def test_what_is_admitted_over_any_stretch_stays_within_the_limit(
    limit: int, steps: list[tuple[float, int, float]]
) -> None:
    """Over [t0, t1] a key gets at most a full bucket plus the refill: L + L * (t1-t0) / 60
    (tokens settled to what was used, the rest given back at once)."""
    limits = Limits(tokens_per_minute=limit)
    budget, now = Budget(), 1000.0
    charged: list[tuple[float, float]] = []  # (when, tokens kept)
    for gap, asked, fraction in steps:
        now += gap
        budget, verdict = admit(budget, limits, Ask(tokens=asked), now)
        if verdict.admitted:
            used = math.floor(asked * fraction)
            budget = release(budget, limits, Ask(tokens=asked - used), now)
            charged.append((now, used))
        else:
            assert verdict.refused_by == "tokens"
    for i, (start, _) in enumerate(charged):
        total = 0.0
        for when, used in charged[i:]:
            total += used
            assert total <= limit + limit * (when - start) / MINUTE + 1e-6


@given(
    limit=LIMITS,
    used=st.floats(min_value=0, max_value=20_000, allow_nan=False),
    asked=st.integers(min_value=1, max_value=10_000),
)
def test_a_refusals_wait_is_exact(limit: int, used: float, asked: int) -> None:
    """Refused now, the same ask is admitted ``retry_after`` seconds later and not a
    millisecond before; an ask over the limit is never admitted (retry_after None)."""
    limits = Limits(tokens_per_minute=limit)
    budget, now = Budget(tokens=Meter(used, 0.0)), 0.0
    after, verdict = admit(budget, limits, Ask(tokens=asked), now)
    if verdict.admitted:
        assert used + asked <= limit + 1e-9
        assert after.tokens.used == pytest.approx(used + asked)
        return
    assert after == budget  # a refusal takes nothing
    if asked > limit:
        assert verdict.retry_after is None
        assert not admit(budget, limits, Ask(tokens=asked), 1e9)[1].admitted
        return
    wait = verdict.retry_after
    assert wait is not None
    assert wait > 0
    assert admit(budget, limits, Ask(tokens=asked), now + wait + 1e-9)[1].admitted
    if wait > 1e-3:
        assert not admit(budget, limits, Ask(tokens=asked), now + wait - 1e-3)[1].admitted


@given(
    limits=st.builds(
        Limits, st.none() | LIMITS, st.none() | LIMITS, st.none() | st.integers(1, 10)
    ),
    asks=st.lists(
        st.builds(Ask, st.integers(0, 3), st.integers(0, 5000), st.integers(0, 2)), max_size=20
    ),
)
def test_giving_back_what_was_taken_restores_the_budget(limits: Limits, asks: list[Ask]) -> None:
    budget, now = Budget(), 50.0
    taken = []
    for ask in asks:
        budget, verdict = admit(budget, limits, ask, now)
        if verdict.admitted:
            taken.append(ask)
    for ask in taken:
        budget = release(budget, limits, ask, now)
    assert budget.inflight == 0
    assert budget.requests.used == pytest.approx(0.0, abs=1e-6)
    assert budget.tokens.used == pytest.approx(0.0, abs=1e-6)


@given(
    limit=LIMITS,
    used=st.floats(min_value=0, max_value=30_000, allow_nan=False),
    later=st.floats(min_value=0, max_value=200, allow_nan=False),
)
def test_standing_is_what_clients_are_told(limit: int, used: float, later: float) -> None:
    """remaining never exceeds the limit nor goes below 0, and the bucket is full when its
    reset says (nothing used any more)."""
    limits = Limits(requests_per_minute=limit, tokens_per_minute=limit)
    budget = Budget(Meter(used, 0.0), Meter(used, 0.0))
    requests, tokens = standing(budget, limits, later)
    assert requests == tokens
    assert requests is not None
    assert 0 <= requests.remaining <= limit
    assert used_at(budget.tokens, limit, later + requests.reset) == pytest.approx(0.0, abs=1e-6)


def test_every_limit_is_checked_and_the_longest_wait_told() -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=600, max_inflight=2)
    budget = Budget(Meter(60.0, 0.0), Meter(600.0, 0.0), inflight=0)
    # a request frees in 1 s, 100 tokens in 10 s: the tokens' wait is told
    _, verdict = admit(budget, limits, Ask(1, 100, 1), 0.0)
    assert not verdict.admitted
    assert verdict.refused_by == "tokens"
    assert verdict.retry_after == pytest.approx(10.0)
    assert verdict.requests is not None
    assert verdict.requests.remaining == 0
    # a key at its max_inflight is refused whatever its minute holds
    _, busy = admit(Budget(inflight=2), limits, Ask(1, 1, 1), 0.0)
    assert (busy.admitted, busy.refused_by) == (False, "inflight")
    # a request larger than the minute is never admitted
    _, large = admit(Budget(), limits, Ask(1, 601, 1), 0.0)
    assert (large.refused_by, large.retry_after) == ("tokens", None)


def test_a_settlement_may_leave_a_key_in_debt_until_the_bucket_refills() -> None:
    limits = Limits(tokens_per_minute=60)  # one token a second
    budget, verdict = admit(Budget(), limits, Ask(tokens=10), 0.0)
    assert verdict.admitted
    budget = release(budget, limits, Ask(tokens=-100), 0.0)  # used 110 of a reserved 10
    assert budget.tokens.used == 110
    _, refused = admit(budget, limits, Ask(tokens=1), 0.0)
    assert refused.retry_after == pytest.approx(51.0)  # 110 + 1 - 60 tokens to refill
    assert admit(budget, limits, Ask(tokens=1), 51.0)[1].admitted


def test_limits_are_shared_among_frontends_when_they_cannot_agree() -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=1000, max_inflight=3)
    assert limits.share(1) is limits
    assert limits.share(2) == Limits(5, 500, 1)
    assert limits.share(100) == Limits(1, 10, 1)  # never 0: a key keeps a trickle
    assert Limits().share(4) == Limits()


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.0004, "1ms"),
        (0.012, "12ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.999, "59.999s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (3723.25, "1h2m3.25s"),
    ],
)
def test_resets_are_said_as_openai_says_them(seconds: float, said: str) -> None:
    assert duration(seconds) == said


def test_resets_are_said_as_anthropic_says_them() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00Z"
    assert rfc3339(1_767_225_600.2) == "2026-01-01T00:00:01Z"  # rounded up: full by then


@settings(max_examples=50)
@given(st.floats(min_value=0, max_value=1e7, allow_nan=False))
def test_a_duration_is_never_shorter_than_the_wait(seconds: float) -> None:
    """A client waiting what it is told never comes back early."""
    said = duration(seconds)
    total, rest = 0.0, said
    for unit, factor in (("h", 3600), ("m", 60)):
        if unit in rest and not rest.endswith("ms"):
            head, _, rest = rest.partition(unit)
            total += int(head) * factor
    total += float(rest[:-2]) / 1000 if rest.endswith("ms") else float(rest[:-1])
    assert total >= seconds - 1e-9
    assert total <= seconds + 1e-3 + 1e-9


class _Request:
    """A graph request as the reservation reads it (chat: no prompts; completions: some)."""

    def __init__(self, max_tokens: int | None, n: int, prompts: int) -> None:
        self.requested_max_tokens = (max_tokens, "max_tokens")
        self.n = n
        self.prompts = ["p"] * prompts if prompts else None


@given(
    max_tokens=st.none() | st.integers(1, 5000),
    n=st.integers(1, 4),
    prompts=st.integers(0, 3),
    prompt=st.integers(1, 4000),
    context=st.none() | st.integers(4001, 9000),
    tpm=st.none() | LIMITS,
    body=st.integers(0, 40_000),
)
def test_a_reservation_covers_the_prompt_and_never_refuses_what_no_limit_asked(
    max_tokens: int | None,
    n: int,
    prompts: int,
    prompt: int,
    context: int | None,
    tpm: int | None,
    body: int,
) -> None:
    from operators.edges.http.reservation import estimate, needed

    request = _Request(max_tokens, n, prompts)
    choices = n * max(prompts, 1)
    whole = needed(request, prompt, context, tpm)
    assert whole >= prompt
    if max_tokens is not None:
        assert whole == prompt + max_tokens * choices
    elif context is not None and tpm is not None:
        assert whole <= max(prompt, tpm)  # no limit asked: at most what the minute holds
    held, cost = estimate(request, body, context, tpm)
    assert cost >= held >= 0
    if tpm is None:
        assert held == 0
    elif max_tokens is None or max_tokens * choices <= tpm:
        assert held <= tpm  # an estimate never makes a request "too large"
    else:
        assert held > tpm  # its own output limit alone is: a 429 no wait lifts
