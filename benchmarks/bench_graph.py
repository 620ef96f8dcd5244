"""The whole default graph in-process: tokens/s from the echo engine to OpenAI chunk dicts.

Run on demand: ``.venv/bin/python benchmarks/bench_graph.py [--loop asyncio|uvloop]``.
No HTTP: this is the framework's own cost per token (preprocessor, Migration, Backend,
both routers, echo), the budget the project aims to keep at >= 150k tokens/s on one core
with the echo engine yielding to the loop once per token. The default loop is uvloop, the
one ``llm-pipeline serve`` runs on; rates are CPU time of this process (best of 3), so
another process on the machine disturbs them less than wall time would.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.edges.openai.protocol import parse_chat_request
from operators.engines import EchoEngine
from operators.graph import default_graph
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Stream, open_stream


class Eager:
    """An engine that never gives the event loop a turn: the framework's cost alone.

    (The echo engine yields to the loop once per token, as a fair engine must; that turn is
    about half of the echo rows' cost.)
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._ids = tokenizer.encode("the quick brown fox jumps over the dog ")

    async def generate(self, ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]:
        ids = self._ids
        last = (ctx.data.stop.max_tokens or 1) - 1
        for i in range(last + 1):
            finish = "length" if i == last else None
            yield EngineOutput(token_ids=[ids[i % len(ids)]], finish_reason=finish)


async def measure(
    max_tokens: int, *, stop: list[str], logprobs: bool, eager: bool = False
) -> tuple[float, int]:
    tokenizer = Tokenizer.default()
    engine: Any = Eager(tokenizer) if eager else EchoEngine.from_tokenizer(tokenizer, cycle=True)
    graph = default_graph(engine, tokenizer, model_name="echo")
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": "the quick brown fox jumps over the dog " * 8}],
        "stream": True,
        "max_tokens": max_tokens,
        "stop": stop or None,
        "logprobs": logprobs,
        "top_logprobs": 2 if logprobs else None,
    }
    request = parse_chat_request({k: v for k, v in body.items() if v is not None})
    best = float("inf")
    chunks = 0
    for _ in range(3):
        start = time.process_time()
        chunks = 0
        async with open_stream(graph, Context.new(request)) as stream:
            async for _ in stream:
                chunks += 1
        best = min(best, time.process_time() - start)
    return max_tokens / best, chunks


async def main() -> None:
    print(f"{'scenario':<36}{'tokens/s':>12}{'µs/token':>10}")
    stops = ["zebra", "QQ", "lazy cat", "fox jumps under"]
    for label, stop, logprobs, eager in (
        ("echo, no stops", [], False, False),
        ("echo, 4 stop strings", stops, False, False),
        ("echo, 4 stops + logprobs (top 2)", stops, True, False),
        ("eager engine, no stops", [], False, True),
        ("eager engine, 4 stop strings", stops, False, True),
    ):
        rate, _ = await measure(16_000, stop=stop, logprobs=logprobs, eager=eager)
        print(f"{label:<36}{rate:>12,.0f}{1e6 / rate:>10.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    loop = parser.parse_args().loop
    print(f"event loop: {loop}")
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})
