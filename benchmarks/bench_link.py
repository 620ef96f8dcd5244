"""Per-item cost of link(): items/s through chains of pass-through operators.

Streams ``--items`` integers from a trivial engine through 0 (the bare engine), 1, 4 and
8 pass-through operators, driven by ``open_stream`` as a server would, and reports the
overhead each operator adds per item: ``(t_depth - t_0) / depth / items``.

Run it: ``python benchmarks/bench_link.py [--items 200000] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio

from pipeline import Context, Engine, Stream, link, open_stream

DEPTHS = (0, 1, 4, 8)


class CountEngine:
    """Yields ``ctx.data`` integers with no await in between: the cheapest possible engine."""

    async def generate(self, ctx: Context[int], /) -> Stream[int]:
        for i in range(ctx.data):
            yield i


class PassThrough:
    """The cheapest possible operator."""

    async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> Stream[Any]:
        async for item in downstream.generate(ctx):
            yield item


async def drain(engine: Engine[int, int], items: int) -> float:
    """Seconds to stream ``items`` items from ``engine``."""
    ctx = Context.new(items)
    count = 0
    start = time.perf_counter()
    async with open_stream(engine, ctx) as stream:
        async for _ in stream:
            count += 1
    elapsed = time.perf_counter() - start
    assert count == items
    return elapsed


async def main(items: int, repeat: int) -> None:
    best: dict[int, float] = {}
    for depth in DEPTHS:
        graph = link(*[PassThrough() for _ in range(depth)], CountEngine())
        best[depth] = min([await drain(graph, items) for _ in range(repeat)])
    python = ".".join(map(str, sys.version_info[:3]))
    print(f"{items} items through pass-through operators, best of {repeat} runs, Python {python}")
    print(f"{'depth':>5} {'items/s':>12} {'µs/item':>9} {'µs/item/operator':>17}")
    for depth in DEPTHS:
        seconds = best[depth]
        per_item = seconds / items * 1e6
        overhead = "-" if depth == 0 else f"{(seconds - best[0]) / depth / items * 1e6:.3f}"
        print(f"{depth:>5} {items / seconds:>12,.0f} {per_item:>9.3f} {overhead:>17}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    arguments = parser.parse_args()
    anyio.run(main, arguments.items, arguments.repeat)
