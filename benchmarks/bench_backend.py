"""Backend throughput: tokens/s through Backend over a trivial engine, per stop-set size.

Run on demand: ``.venv/bin/python benchmarks/bench_backend.py``. The interesting number is
whether µs/token stays flat as the output grows (no O(output) work per token) and how much
a large stop set costs.
"""

from __future__ import annotations

import random
import time

import anyio

from operators.backend import Backend
from operators.contracts.llm import EngineOutput, PreprocessedRequest, StopConditions
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Stream, link, open_stream

TEXT = (
    "The quick brown fox jumps over the lazy dog while the committee reviews "
    "its quarterly numbers, 1234 of them, and nobody says stop. "
)


class Replay:
    """An engine that replays prebuilt outputs as fast as the event loop allows."""

    def __init__(self, outputs: list[EngineOutput]) -> None:
        self._outputs = outputs

    async def generate(self, ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]:
        for output in self._outputs:
            yield output


def near_miss_stops(count: int, rng: random.Random) -> tuple[str, ...]:
    words = TEXT.split()
    return tuple(f"{rng.choice(words)} {rng.choice(words)}QQ" for _ in range(count))


async def measure(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> float:
    outputs = [EngineOutput(token_ids=[i]) for i in ids]
    request = PreprocessedRequest(
        token_ids=[1, 2, 3], stop=StopConditions(stop=stops, max_tokens=len(ids))
    )
    graph = link(Backend(tokenizer), Replay(outputs))
    best = float("inf")
    for _ in range(3):
        ctx = Context.new(request)
        start = time.perf_counter()
        async with open_stream(graph, ctx) as stream:
            async for _ in stream:
                pass
        best = min(best, time.perf_counter() - start)
    return best / len(ids) * 1e6


async def main() -> None:
    tokenizer = Tokenizer.default()
    rng = random.Random(7)
    base = tokenizer.encode(TEXT * 400)
    print(f"{'scenario':<34}{'1k':>10}{'4k':>10}{'16k':>10}   (µs/token; tokens/s at 16k)")
    for count in (0, 4, 64):
        stops = near_miss_stops(count, rng)
        row = [await measure(tokenizer, base[:n], stops) for n in (1000, 4000, 16000)]
        label = f"{count} stop strings"
        print(f"{label:<34}" + "".join(f"{v:>10.2f}" for v in row) + f"   {1e6 / row[-1]:>9,.0f}")
    a = tokenizer.encode("a")
    assert len(a) == 1
    long_stop = ("a" * 200 + "b" + "a" * 200,)
    row = [await measure(tokenizer, a * n, long_stop) for n in (1000, 4000, 16000)]
    label = "long stop a^200 b a^200, 'a' out"
    print(f"{label:<34}" + "".join(f"{v:>10.2f}" for v in row) + f"   {1e6 / row[-1]:>9,.0f}")


if __name__ == "__main__":
    anyio.run(main)
