"""CPU-µs per token through each edge: chat completions, the Responses API, Messages.

Starts ``llm-pipeline serve --engine echo --echo-cycle`` and drives the same streamed
workload (``--prompt-tokens`` in, ``--max-tokens`` out) through each API with the load
generator (``benchmarks/loadgen.py``), in interleaved rounds so that the machine's noise
falls on every edge alike. Prints, per edge, the server's CPU time per output token
(median over the rounds), tokens/s, and the ratio to chat completions (the goal: within
10 %)::

    .venv/bin/python benchmarks/bench_edges.py --concurrency 16 --requests 400 --rounds 3

Responses are streamed with ``store: false`` (the store's own cost is
``benchmarks/bench_responses_store.py``'s).

``--parse N`` instead times, in process, what each edge does with a body of N items and of
2N before the graph runs (the JSON, the schema's validation, the conversion into the
graph's request: what ``host.offload`` runs in a worker thread), median of ``--rounds``;
the last column is the 2N time over the N time (linear: about 2)::

    .venv/bin/python benchmarks/bench_edges.py --parse 250000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import loadgen
import orjson

ROOT = Path(__file__).resolve().parents[1]
BANNER = re.compile(rb"on (http://\S+)")


def start_server(*options: str) -> tuple[subprocess.Popen[bytes], str]:
    """``llm-pipeline serve`` on a free port; (process, base URL)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "operators.cli", "serve", "--port", "0", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    match = BANNER.search(line)
    if match is None:
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return process, match.group(1).decode()


def run_loadgen(url: str, pid: int, api: str, args: argparse.Namespace) -> dict[str, object]:
    argv = [
        "--url", url, "--api", api, "--server-pid", str(pid),
        "--concurrency", str(args.concurrency), "--requests", str(args.requests),
        "--warmup", str(args.warmup), "--prompt-tokens", str(args.prompt_tokens),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    return asyncio.run(loadgen.main_async(loadgen.parse_args(argv)))


def _turns(n: int) -> list[dict[str, str]]:
    """n turns, the user's and the assistant's in turn, the last the user's."""
    return [{"role": "user" if (n - i) % 2 else "assistant", "content": "a"} for i in range(n)]


def _parsers() -> dict[str, tuple[Callable[[bytes], Any], Callable[[int], dict[str, Any]]]]:
    """Each edge: (what it does with a body before the graph, a body of n items)."""
    from operators.edges.anthropic.conversation import chat_request as anthropic_chat
    from operators.edges.anthropic.protocol import (
        parse_count_tokens_request,
        parse_messages_request,
    )
    from operators.edges.http.schema import parse_body
    from operators.edges.openai.embeddings import parse_embedding_request
    from operators.edges.openai.protocol import parse_chat_request, parse_completion_request
    from operators.edges.openai.tokenize import DetokenizeRequest, TokenizeRequest
    from operators.edges.responses.conversation import chat_request, input_items
    from operators.edges.responses.protocol import parse_responses_request

    def responses(body: bytes) -> Any:
        request = parse_responses_request(body)
        return chat_request(request, input_items(request, "x"))

    def messages(body: bytes) -> Any:
        return anthropic_chat(parse_messages_request(body))

    def count_tokens(body: bytes) -> Any:
        return anthropic_chat(parse_count_tokens_request(body))

    def tokenize(body: bytes) -> Any:
        request = parse_body(TokenizeRequest, body)
        return parse_chat_request({"messages": request.messages})

    return {
        "chat": (parse_chat_request, lambda n: {"messages": _turns(n)}),
        "completions": (parse_completion_request, lambda n: {"prompt": [[7, 8]] * n}),
        "responses": (responses, lambda n: {"input": _turns(n)}),
        "messages": (messages, lambda n: {"model": "m", "max_tokens": 5, "messages": _turns(n)}),
        "count_tokens": (count_tokens, lambda n: {"model": "m", "messages": _turns(n)}),
        "embeddings": (parse_embedding_request, lambda n: {"input": [7] * n}),
        "tokenize": (tokenize, lambda n: {"messages": _turns(n)}),
        "detokenize": (
            lambda body: parse_body(DetokenizeRequest, body),
            lambda n: {"tokens": [7] * n},
        ),
        "chat-tools": (
            parse_chat_request,
            lambda n: {
                "messages": _turns(1),
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)],
            },
        ),
    }


def parse_times(items: int, rounds: int) -> None:
    """Print each edge's parse time for ``items`` and ``2 * items`` items."""
    print(f"what each edge does with a body before the graph, median of {rounds} rounds")
    print(f"{'edge':<14}{'MB':>7}{f'{items} items':>16}{f'{2 * items} items':>16}{'ratio':>8}")
    for edge, (parse, make) in _parsers().items():
        seconds = []
        for count in (items, 2 * items):
            body = orjson.dumps(make(count))
            runs = []
            for _ in range(rounds):
                gc.collect()  # (the last round's garbage is not this one's)
                started = time.process_time()
                parse(body)
                runs.append(time.process_time() - started)
            seconds.append(statistics.median(runs))
        size = len(orjson.dumps(make(items))) / 1e6
        print(
            f"{edge:<14}{size:>7.1f}{seconds[0] * 1e3:>13.1f} ms{seconds[1] * 1e3:>13.1f} ms"
            f"{seconds[1] / max(seconds[0], 1e-9):>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--apis", default="chat,responses,messages")
    parser.add_argument(
        "--parse", type=int, default=0, metavar="N", help="time the parse of N and 2N items"
    )
    args = parser.parse_args()
    if args.parse:
        parse_times(args.parse, args.rounds)
        return
    apis = args.apis.split(",")
    process, url = start_server("--engine", "echo", "--echo-cycle")
    cpu: dict[str, list[float]] = {api: [] for api in apis}
    rate: dict[str, list[float]] = {api: [] for api in apis}
    try:
        for round_number in range(args.rounds):
            for api in apis if round_number % 2 == 0 else apis[::-1]:
                report = run_loadgen(url, process.pid, api, args)
                if report["errors"]:
                    raise RuntimeError(f"{api}: {report['errors']} errors: {report['first_error']}")
                cpu[api].append(float(report["server_cpu_us_per_token"]))  # type: ignore[arg-type]
                rate[api].append(float(report["output_tokens_per_s"]))  # type: ignore[arg-type]
    finally:
        process.terminate()
        process.wait(30)
    print(
        f"echo engine, {args.prompt_tokens} -> {args.max_tokens} tokens, concurrency "
        f"{args.concurrency}, {args.requests} requests x {args.rounds} rounds per edge"
    )
    print(f"{'edge':<12}{'server CPU-µs/token':>22}{'tokens/s':>12}{'vs chat':>10}")
    base = statistics.median(cpu[apis[0]])
    for api in apis:
        median = statistics.median(cpu[api])
        runs = " ".join(f"{value:.1f}" for value in cpu[api])
        print(
            f"{api:<12}{median:>22.1f}{statistics.median(rate[api]):>12.0f}"
            f"{median / base - 1:>+10.1%}   (rounds: {runs})"
        )


if __name__ == "__main__":
    main()
