"""Per-token cost of the output parsers (tool calls, reasoning) on the echo engine.

Run on demand: ``.venv/bin/python benchmarks/bench_parsers.py [--loop asyncio|uvloop]``.

Each row streams ``TOKENS`` tokens of a text through ``link(OutputParsers(...),
Backend(tokenizer), EchoEngine)`` (the echo engine cycles the text, one token per loop
turn), with SmolLM2's tokenizer. "plain" is text without any markup: what every request
with tools pays when the model just answers. "markup" is the format's own calls (or
``<think>`` blocks) over and over, so the parser withholds, parses JSON and emits calls.
"no parser" is the same graph without one (``OutputParsers()`` is a passthrough that adds
no hop) on the same text, run alternately with it; "added" is the difference, what a
request pays for parsing (the operator's hop included). "sans-IO" is the parsers alone,
fed each token's text without an event loop or operator. Times are CPU time of this
process, best of 7, as in ``bench_graph.py``, with the garbage collector tuned as
``serve`` tunes it; the machine's noise shows in the spread
between runs. No timing is asserted.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from operators.backend import Backend
from operators.cli.tuning import tune_gc
from operators.contracts.llm import PreprocessedRequest, Tool
from operators.engines import EchoEngine
from operators.parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    THINK,
    ChoiceParser,
    OutputParsers,
    ReasoningFormat,
    ToolCallFormat,
)
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer
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


ROUNDS = 7


async def run_once(graph: Any, request: PreprocessedRequest) -> tuple[float, dict[str, int]]:
    """CPU seconds for one request, and what the client got (to check the parse)."""
    seen = {"tokens": 0, "content": 0, "reasoning": 0, "calls": 0}
    start = time.process_time()
    async with open_stream(graph, Context.new(request)) as stream:
        async for output in stream:
            seen["tokens"] += len(output.token_ids)
            seen["content"] += len(output.text)
            seen["reasoning"] += len(output.reasoning)
            seen["calls"] += sum(1 for call in output.tool_calls or () if call.id)
    elapsed = time.process_time() - start
    assert seen["tokens"] == TOKENS, seen
    return elapsed, seen


async def compare(
    tokenizer: Tokenizer, parsers: OutputParsers, text: str
) -> tuple[float, float, dict[str, int]]:
    """Best-of-ROUNDS µs per token with the parsers and without, runs alternating (so a
    busy neighbour on the machine slows both alike), and what the client got."""
    engine = EchoEngine.from_tokenizer(tokenizer, cycle=True)
    with_parsers = link(parsers, Backend(tokenizer), engine)
    without = link(OutputParsers(), Backend(tokenizer), engine)
    req = make_request(tokenizer.encode(text), max_tokens=TOKENS, tools=TOOLS)
    best, base = float("inf"), float("inf")
    seen: dict[str, int] = {}
    for _ in range(ROUNDS):
        elapsed, _ = await run_once(without, req)
        base = min(base, elapsed)
        elapsed, seen = await run_once(with_parsers, req)
        best = min(best, elapsed)
    return best / TOKENS * 1e6, base / TOKENS * 1e6, seen


def sans_io(
    tokenizer: Tokenizer,
    tools: ToolCallFormat | None,
    reasoning: ReasoningFormat | None,
    text: str,
) -> float:
    """Best-of-ROUNDS µs per token of the parsers alone (no event loop, no operator):
    :class:`ChoiceParser.feed` on each token's text, then ``finish``."""
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([token_id]) for token_id in ids]
    stream = [pieces[i % len(pieces)] for i in range(TOKENS)]
    best = float("inf")
    for _ in range(ROUNDS):
        parser = ChoiceParser(
            None if reasoning is None else reasoning.parser(),
            None if tools is None else tools.parser(TOOLS),
        )
        feed = parser.feed
        start = time.process_time()
        for piece in stream:
            feed(piece)
        parser.finish()
        best = min(best, time.process_time() - start)
    return best / TOKENS * 1e6


async def main() -> None:
    tokenizer = Tokenizer.default()
    tune_gc()  # as ``serve`` runs: young collections off the per-token path
    texts = {"plain": PLAIN, **{f"{name} markup": text for name, text in MARKUP.items()}}
    print(
        f"{'parser':<14}{'text':<21}{'graph µs':>9}{'no parser':>10}{'added':>7}"
        f"{'sans-IO':>9}{'calls':>7}"
    )
    for name, (tools, reasoning) in PARSERS.items():
        for label in ("plain", f"{name} markup"):
            text = texts[label]
            cost, base, seen = await compare(tokenizer, OutputParsers(tools, reasoning), text)
            if label != "plain":
                assert seen["calls"] or seen["reasoning"], (name, seen)  # markup was parsed
            alone = sans_io(tokenizer, tools, reasoning, text)
            print(
                f"{name:<14}{label:<21}{cost:>9.2f}{base:>10.2f}{cost - base:>7.2f}"
                f"{alone:>9.2f}{seen['calls']:>7}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    loop = parser.parse_args().loop
    print(f"event loop: {loop}; {TOKENS} tokens per run")
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})
