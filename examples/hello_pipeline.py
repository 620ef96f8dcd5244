"""The smallest graph: one operator linked in front of an engine, streamed with open_stream.

Run it: ``python examples/hello_pipeline.py``.
"""

from __future__ import annotations

import anyio

from pipeline import Context, Engine, FunctionEngine, Stream, link, open_stream


async def words(ctx: Context[str]) -> Stream[str]:
    """The engine: streams the request's words back, one at a time."""
    for word in ctx.data.split():
        yield word


class Shout:
    """The operator: upper-cases every output on its way back to the caller."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for word in downstream.generate(ctx):
            yield word.upper() + "!"


async def main() -> None:
    graph = link(Shout(), FunctionEngine(words))
    async with open_stream(graph, Context.new("hello pipeline world")) as stream:
        async for word in stream:
            print(word)


if __name__ == "__main__":
    anyio.run(main)
