"""Benchmark `StopJail.push`: microseconds per push as the stream and the stop set grow.

Why this script exists: bug class B12 (``docs/bug-classes.md``) is stop matching whose
per-token cost grows with the output or with the stop length. The tests only check
correctness, so this is where the cost claim is measured: µs/push must stay flat from 1k
to 16k pushes (a quadratic matcher would grow 16x), including for the long repetitive stop
``"a"*200 + "b" + "a"*200`` under sustained ``"a"`` output. A naive matcher that rescans the
whole output on every push (`find_stop` on the accumulated text) is timed alongside it, so
the table shows what growth would look like.

Run on demand: ``.venv/bin/python benchmarks/bench_stop_jail.py``. No timing is asserted.
"""

from __future__ import annotations

import functools
import random
import string
import time
from collections.abc import Callable, Sequence

from operators.text.stop_jail import Released, StopJail, StopMatcher, find_stop

__all__ = ()

SIZES = (1_000, 4_000, 16_000)
REPEATS = 5
LONG_STOP = "a" * 200 + "b" + "a" * 200
WORD_CHARS = string.ascii_lowercase + "     ,."


def word_tokens(count: int, rng: random.Random) -> list[str]:
    """~4-character tokens over lowercase text, spaces and punctuation."""
    return ["".join(rng.choices(WORD_CHARS, k=rng.randint(3, 5))) for _ in range(count)]


def near_miss_stops(count: int, rng: random.Random) -> list[str]:
    """Stops whose prefixes keep appearing in the text but which never complete ("Q")."""
    return [
        "".join(rng.choices(string.ascii_lowercase + " ", k=rng.randint(2, 10))) + "Q"
        for _ in range(count)
    ]


def time_jail(stops: Sequence[str], tokens: Sequence[str]) -> float:
    """Best-of-REPEATS µs per push for one fresh jail fed every token."""
    StopMatcher.compile(tuple(stops))  # warm the cache: we time matching, not building
    best = float("inf")
    for _ in range(REPEATS):
        jail = StopJail(stops)
        push = jail.push
        start = time.perf_counter()
        for token in tokens:
            push(token)
        elapsed = time.perf_counter() - start
        if jail.stopped:
            raise AssertionError("benchmark stream hit a stop string; fix the generator")
        best = min(best, elapsed)
    return best / len(tokens) * 1e6


def time_naive(stops: Sequence[str], tokens: Sequence[str]) -> float:
    """µs per push for rescanning the whole output each push (the B12 anti-pattern)."""
    start = time.perf_counter()
    text = ""
    for token in tokens:
        text += token
        if find_stop(text, stops) is not None:
            raise AssertionError("benchmark stream hit a stop string")
    return (time.perf_counter() - start) / len(tokens) * 1e6


def time_build(stops: Sequence[str]) -> float:
    """Best-of-REPEATS milliseconds to build an uncached automaton."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        StopMatcher(stops)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def time_prefix(
    timer: Callable[[Sequence[str], Sequence[str]], float],
    stops: Sequence[str],
    stream: Sequence[str],
    n: int,
) -> float:
    return timer(stops, stream[:n])


def row(label: str, per_size: Callable[[int], float]) -> str:
    values = [per_size(n) for n in SIZES]
    cells = "".join(f"{v:>12.3f}" for v in values)
    return f"{label:<36}{cells}{values[-1] / values[0]:>12.2f}"


def main() -> None:
    rng = random.Random(0)
    tokens = word_tokens(max(SIZES), rng)
    realistic = ["\n\nHuman:", "</s>", "<|im_end|>", "###"]
    stops_4 = near_miss_stops(4, rng)
    stops_64 = near_miss_stops(64, rng)
    long_tokens = ["a"] * max(SIZES)
    long_stops = [LONG_STOP]
    # Sanity: the long stop is withheld, never matched, and each push releases one "a".
    probe = StopJail(long_stops)
    for _ in range(200):
        probe.push("a")
    assert probe.push("a") == Released("a")
    assert probe.withheld == "a" * 200

    header = "".join(f"{f'{n // 1000}k pushes':>12}" for n in SIZES)
    print("StopJail.push, µs per push (best of 5); last column = cost(16k) / cost(1k)")
    print(f"{'scenario':<36}{header}{'16k/1k':>12}")
    print("-" * (36 + 12 * len(SIZES) + 12))
    cases: list[tuple[str, Sequence[str], Sequence[str]]] = [
        ("0 stops (fast path), ~4-char tokens", [], tokens),
        ("4 realistic stops, ~4-char tokens", realistic, tokens),
        ("4 near-miss stops, ~4-char tokens", stops_4, tokens),
        ("64 near-miss stops, ~4-char tokens", stops_64, tokens),
        ("long a^200 b a^200, 'a' pushes", long_stops, long_tokens),
    ]
    for label, stops, stream in cases:
        print(row(label, functools.partial(time_prefix, time_jail, stops, stream)))
    print(
        row(
            "contrast: naive rescan, 64 stops",
            functools.partial(time_prefix, time_naive, stops_64, tokens),
        )
    )
    print()
    print("automaton build (uncached), ms:")
    for label, stops in [
        ("4 near-miss stops", stops_4),
        ("64 near-miss stops", stops_64),
        ("long a^200 b a^200", long_stops),
    ]:
        matcher = StopMatcher(stops)
        print(f"  {label:<24}{time_build(stops):>8.3f}   states={matcher.state_count}")


if __name__ == "__main__":
    main()
