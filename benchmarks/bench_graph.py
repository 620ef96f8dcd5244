"""The whole default graph in-process: tokens/s from the echo engine to OpenAI chunk dicts.

Run on demand: ``.venv/bin/python benchmarks/bench_graph.py``. No HTTP: this is the
framework's own cost per token (preprocessor, Migration, Backend, both routers, echo), the
budget the project aims to keep at >= 200k tokens/s on one core.
"""

from __future__ import annotations

import time

import anyio

from operators.engines import EchoEngine
from operators.graph import default_graph
from operators.openai.protocol import parse_chat_request
from operators.tokenizer import Tokenizer
from pipeline import Context, open_stream


async def measure(max_tokens: int, *, stop: list[str], logprobs: bool) -> tuple[float, int]:
    tokenizer = Tokenizer.default()
    graph = default_graph(
        EchoEngine.from_tokenizer(tokenizer, cycle=True), tokenizer, model_name="echo"
    )
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
        start = time.perf_counter()
        chunks = 0
        async with open_stream(graph, Context.new(request)) as stream:
            async for _ in stream:
                chunks += 1
        best = min(best, time.perf_counter() - start)
    return max_tokens / best, chunks


async def main() -> None:
    print(f"{'scenario':<36}{'tokens/s':>12}{'µs/token':>10}")
    for label, stop, logprobs in (
        ("no stops", [], False),
        ("4 stop strings", ["zebra", "QQ", "lazy cat", "fox jumps under"], False),
        ("4 stops + logprobs (top 2)", ["zebra", "QQ", "lazy cat", "fox jumps under"], True),
    ):
        rate, _ = await measure(16_000, stop=stop, logprobs=logprobs)
        print(f"{label:<36}{rate:>12,.0f}{1e6 / rate:>10.2f}")


if __name__ == "__main__":
    anyio.run(main)
