"""Per-token cost of the output parsers (tool calls, reasoning) on the echo engine.

Run on demand: ``.venv/bin/python benchmarks/bench_parsers.py [--loop asyncio|uvloop]``.

Each row streams ``TOKENS`` tokens of a text through ``link(OutputParsers(...),
Backend(tokenizer), EchoEngine)`` (the echo engine cycles the text, one token per loop
turn), with SmolLM2's tokenizer. "plain" is text without any markup: what every request
with tools pays when the model just answers. "markup" is the format's own calls (or
``<think>`` blocks) over and over, so the parser withholds, parses JSON and emits calls.
The baseline row is the same graph without a parser (``OutputParsers()`` is a passthrough
that adds no hop), on each text; the cost column is the difference. Rates are CPU time of
this process (best of 3), as in ``bench_graph.py``. No timing is asserted.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from operators.backend import Backend
from operators.engines import EchoEngine
from operators.llm import PreprocessedRequest, StopConditions, Tool
from operators.parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    THINK,
    OutputParsers,
    ReasoningFormat,
    ToolCallFormat,
)
from operators.tokenizer import Tokenizer
from pipeline import Context, link, open_stream

__all__ = ()

TOKENS = 16_000
TOOLS = (
    Tool(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    ),
)
PLAIN = "The quick brown fox jumps over the lazy dog; it was 22 °C in Paris. "
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
MARKUP = {
    "hermes": f"Let me check. <tool_call>\n{WEATHER}\n</tool_call>\n",
    "mistral": f"Let me check. [TOOL_CALLS][{WEATHER}]\n",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; ',
    "pythonic": '[get_weather(city="Paris"), get_weather(city="Rome")]',
    "think": "<think>The user wants the weather in Paris.</think>It is sunny. ",
    "think+hermes": f"<think>The user wants Paris.</think>Sure. <tool_call>{WEATHER}</tool_call>",
}
PARSERS: dict[str, tuple[ToolCallFormat | None, ReasoningFormat | None]] = {
    "hermes": (HERMES, None),
    "mistral": (MISTRAL, None),
    "llama3_json": (LLAMA3_JSON, None),
    "pythonic": (PYTHONIC, None),
    "think": (None, THINK),
    "think+hermes": (HERMES, THINK),
}


async def measure(
    tokenizer: Tokenizer, parsers: OutputParsers, text: str
) -> tuple[float, dict[str, int]]:
    """Best-of-3 CPU µs per token, and what the client got (to check the parse)."""
    engine = EchoEngine.from_tokenizer(tokenizer, cycle=True)
    graph: Any = link(parsers, Backend(tokenizer), engine)
    request = PreprocessedRequest(
        token_ids=tokenizer.encode(text), stop=StopConditions(max_tokens=TOKENS), tools=TOOLS
    )
    best = float("inf")
    seen: dict[str, int] = {}
    for _ in range(3):
        seen = {"tokens": 0, "content": 0, "reasoning": 0, "calls": 0}
        start = time.process_time()
        async with open_stream(graph, Context.new(request)) as stream:
            async for output in stream:
                seen["tokens"] += len(output.token_ids)
                seen["content"] += len(output.text)
                seen["reasoning"] += len(output.reasoning)
                seen["calls"] += sum(1 for call in output.tool_calls or () if call.id)
        best = min(best, time.process_time() - start)
    assert seen["tokens"] == TOKENS, seen
    return best / TOKENS * 1e6, seen


async def main() -> None:
    tokenizer = Tokenizer.default()
    texts = {"plain": PLAIN, **{f"{name} markup": text for name, text in MARKUP.items()}}
    baseline = {}
    for label, text in texts.items():
        baseline[label], _ = await measure(tokenizer, OutputParsers(), text)
    print(f"{'parser':<14}{'text':<20}{'µs/token':>10}{'parser µs':>11}{'calls':>8}")
    print(f"{'(none)':<14}{'plain':<20}{baseline['plain']:>10.2f}{'':>11}{'':>8}")
    for name, (tools, reasoning) in PARSERS.items():
        for label in ("plain", f"{name} markup"):
            cost, seen = await measure(tokenizer, OutputParsers(tools, reasoning), texts[label])
            if label != "plain":
                assert seen["calls"] or seen["reasoning"], (name, seen)  # markup was parsed
            extra = cost - baseline[label]
            print(f"{name:<14}{label:<20}{cost:>10.2f}{extra:>11.2f}{seen['calls']:>8}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    loop = parser.parse_args().loop
    print(f"event loop: {loop}; {TOKENS} tokens per run")
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})
