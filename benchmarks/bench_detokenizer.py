"""Benchmark incremental detokenization: µs per token, DecodeStream vs the byte-level fast path.

Why this script exists: the detokenizer runs once per generated token and was ~15% of the
in-process graph's per-token CPU with ``DecodeStream``. ``ByteLevelDecoder`` must stay well
under that (target ≤ 0.3 µs per ordinary token) while returning identical results, which the
tests check; this is where the cost is measured. Streams:

* ``ascii``: English prose (every token complete UTF-8: the fast path).
* ``mixed``: prose with CJK and emoji (some characters split across tokens: the slow path).
* ``specials``: chat turns, decoded with ``skip_special_tokens=True``.

Each row is the median of REPEATS runs of a fresh decoder over the whole stream, after one
warm-up run (which fills the byte-level vocabulary cache, as serving would after a few
requests). The ``step`` loop is all that is timed. Run on demand:
``PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_detokenizer.py``. No timing is asserted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from operators.text.detokenizer import IncrementalDecoder, StreamDecoder
from operators.text.tokenizer import Tokenizer

__all__ = ()

REPEATS = 15

_PROSE = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst "
    "of times; numbers like 12345 and 3.14159 show up too, as do (brackets) and 'quotes'. "
)
_MIXED = "Hello 你好, 世界! Party time 🥳🎉 — naïve café, Ελληνικά, русский текст. "
_CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"


def time_decoder(make: Callable[[], IncrementalDecoder], ids: list[int]) -> float:
    """Median µs per token of ``step`` over ``ids`` for fresh decoders from ``make``."""
    runs = []
    for attempt in range(REPEATS + 1):
        decoder = make()
        step = decoder.step
        start = time.perf_counter()
        for token_id in ids:
            step(token_id)
        elapsed = time.perf_counter() - start
        decoder.flush()
        if attempt:  # the first run warms caches
            runs.append(elapsed)
    return statistics.median(runs) / len(ids) * 1e6


def main() -> None:
    tokenizer = Tokenizer.default()
    streams = {
        "ascii": (tokenizer.encode(_PROSE * 60), False),
        "mixed": (tokenizer.encode(_MIXED * 60), False),
        "specials": (tokenizer.encode(_CHAT * 60), True),
    }
    print(f"{'stream':<10}{'tokens':>8}{'DecodeStream µs':>18}{'fast µs':>10}{'speed-up':>10}")
    for name, (ids, skip) in streams.items():

        def stream(skip: bool = skip) -> IncrementalDecoder:
            return StreamDecoder(tokenizer.inner, skip_special_tokens=skip)

        def fast(skip: bool = skip) -> IncrementalDecoder:
            return tokenizer.decode_stream(skip_special_tokens=skip)

        slow_us = time_decoder(stream, ids)
        fast_us = time_decoder(fast, ids)
        print(f"{name:<10}{len(ids):>8}{slow_us:>18.3f}{fast_us:>10.3f}{slow_us / fast_us:>9.1f}x")


if __name__ == "__main__":
    main()
