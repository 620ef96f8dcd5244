"""Traces for the router benchmark (issue 37), in Mooncake's format, and their prompts.

    python benchmarks/router_trace.py --scenario multiturn --out multiturn.jsonl [--scale 0.25]

One JSON object per line, as ``aiperf --custom-dataset-type mooncake_trace`` replays them
(``--fixed-schedule``) and as ``trace_replay.py`` does::

    {"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [0, 1, 2]}

``timestamp`` in milliseconds; each hash id names one block of :data:`BLOCK` (512, Mooncake's)
prompt tokens: requests whose ids agree up to block ``k`` share their first ``k`` blocks of
prompt, the rest of the last block (``input_length`` not a multiple of 512) is the
request's own. Scenarios, each seeded:

- ``multiturn``: conversations sharing a system prompt (2 blocks); each turn resends the
  conversation (history and the previous answer) plus a question of 128 tokens, a think
  time (exponential, 2 s mean) after the previous turn's expected end; conversations start
  staggered. What a kv router should keep on the worker that served the previous turn.
- ``hot-burst``: one hot prefix (8 blocks, 4k tokens) shared by every request, each with a
  question of its own, all arriving within half a second: what herds a router that counts
  cache hits against requests.
- ``long-one-token``: 32k-token documents (64 blocks), each asked several questions with a
  one-token answer (a classifier, a reranker), Poisson arrivals: prefill is all the work.

``--scale`` shrinks the counts (not the shapes), for a smoke run.
:func:`prompt_text` makes a prompt of a line for a replayer that sends text: words that are
one SmolLM2 token each, a block's 512 words a function of its hash id, so that prompts that
share ids share text (and tokens) exactly.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ("BLOCK", "SCENARIOS", "prompt_text", "trace")

#: tokens per hash id (Mooncake's; aiperf's default for ``mooncake_trace``)
BLOCK = 512
SCENARIOS = ("multiturn", "hot-burst", "long-one-token")


def _ids(next_id: list[int], count: int) -> list[int]:
    start = next_id[0]
    next_id[0] += count
    return list(range(start, start + count))


def multiturn(rng: random.Random, scale: float) -> Iterator[dict[str, Any]]:
    conversations, turns = max(2, round(32 * scale)), 6
    system, question, answer = 2 * BLOCK, 128, 64
    next_id = [2]  # 0 and 1: the shared system prompt
    for c in range(conversations):
        at = c * 0.25
        history = system
        full: list[int] = [0, 1]  # ids of the conversation's complete blocks so far
        for _ in range(turns):
            length = history + question
            complete = length // BLOCK
            full += _ids(next_id, complete - len(full))
            ids = full + (_ids(next_id, 1) if length % BLOCK else [])
            yield {"timestamp": round(at * 1000), "input_length": length,
                   "output_length": answer, "hash_ids": ids}  # fmt: skip
            history = length + answer
            at += 0.5 + rng.expovariate(1 / 2.0)  # its answer, then the user's think time


def hot_burst(rng: random.Random, scale: float) -> Iterator[dict[str, Any]]:
    requests, hot = max(4, round(64 * scale)), 8
    for n in range(requests):
        yield {"timestamp": round(rng.uniform(0, 500)), "input_length": hot * BLOCK + 200,
               "output_length": 32, "hash_ids": [*range(hot), 1000 + n]}  # fmt: skip


def long_one_token(rng: random.Random, scale: float) -> Iterator[dict[str, Any]]:
    documents, questions, blocks = max(2, round(8 * scale)), max(2, round(8 * scale)), 64
    asks = [(d, q) for d in range(documents) for q in range(questions)]
    rng.shuffle(asks)
    at = 0.0
    for d, q in asks:
        ids = [*range(d * 1000, d * 1000 + blocks - 1), 100_000 + d * 100 + q]
        yield {"timestamp": round(at * 1000), "input_length": blocks * BLOCK,
               "output_length": 1, "hash_ids": ids}  # fmt: skip
        at += rng.expovariate(1.0)


def trace(scenario: str, *, seed: int = 0, scale: float = 1.0) -> list[dict[str, Any]]:
    """The lines of ``scenario``'s trace, in time order."""
    make = {"multiturn": multiturn, "hot-burst": hot_burst, "long-one-token": long_one_token}
    lines = list(make[scenario](random.Random(seed), scale))
    return sorted(lines, key=lambda line: line["timestamp"])


def prompt_text(line: dict[str, Any], words: Sequence[str]) -> str:
    """The prompt of a trace line: per hash id, :data:`BLOCK` words seeded by the id (the
    last block cut to what ``input_length`` leaves)."""
    length = int(line["input_length"])
    pieces: list[str] = []
    for position, block in enumerate(line["hash_ids"]):
        size = min(BLOCK, length - position * BLOCK)
        if size <= 0:
            break
        rng = random.Random(block)
        pieces.extend(rng.choice(words) for _ in range(size))
    return " ".join(pieces)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the counts (smoke)")
    args = parser.parse_args(argv)
    lines = trace(args.scenario, seed=args.seed, scale=args.scale)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokens = sum(line["input_length"] for line in lines)
    print(f"{args.out}: {len(lines)} requests, {tokens} prompt tokens")


if __name__ == "__main__":
    main()
