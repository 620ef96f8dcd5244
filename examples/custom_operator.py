"""Writing your own operator, and testing it with pipeline.testing.

An operator is a plain class whose ``generate(ctx, downstream)`` is an async generator: no
base class, no decorator. ``pipeline.testing`` gives you a scripted engine to put behind
it, ``collect`` to run it, and ``check_operator`` to check it keeps the operator contract
(context id, early close, errors, kill, no leftover tasks).

Run it: ``python examples/custom_operator.py``.
"""

from __future__ import annotations

import anyio

from pipeline import Context, Engine, Stream, link
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context


class Upper:
    """Upper-cases every output on its way back."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx):
            yield item.upper()


async def test_upper() -> None:
    engine = ScriptedEngine(["a", "b"])
    assert await collect(link(Upper(), engine), make_context("req")) == ["A", "B"]
    await check_operator(Upper, "req", ["a", "b", "c"])


async def main() -> None:
    await test_upper()
    print("Upper passes check_operator")


if __name__ == "__main__":
    anyio.run(main)
