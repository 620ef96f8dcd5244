"""KV-aware routing in one process: each turn of a conversation goes where its prefix is.

Three simulated workers (:class:`MockerEngine` with a prefix cache) report the blocks
they cache as KV events into one :class:`PrefixIndex`; a :class:`KvRouter` reads it
(:func:`llm_kv_router`: one that reads LLM requests) and sends each request to the worker
that would have to prefill the least, weighed against its load (prompt tokens it has
queued, sequences it holds: the mockers report theirs). Two conversations, three turns
each: every turn after the first lands on the worker that served the conversation's
previous turn, and finds that turn's prompt cached.

Over NATS the same index is fed by the workers' published events (``llm-pipeline serve
--nats URL --router kv``); in-process, ``serve --router kv --decode-workers 3`` wires this.

Run it: ``python examples/kv_routing.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from operators.contracts.llm import EngineOutput, PreprocessedRequest, StopConditions
from operators.engines.mocker import MockerEngine
from operators.routing.kv_policy import llm_kv_router
from operators.text.tokenizer import Tokenizer
from pipeline import Context, KvEvent, PrefixIndex, Router, WorkerSet
from pipeline.testing import collect

BLOCK_SIZE = 16
SYSTEM = "You are a concise assistant. Answer in one sentence, then stop. " * 4


def feed(index: PrefixIndex, worker: str) -> Callable[[KvEvent], None]:
    """Applies a worker's KV events (blocks stored, removed, cleared) under its id."""

    def apply(event: KvEvent) -> None:
        index.apply(worker, event)

    return apply


async def main() -> None:
    tokenizer = Tokenizer.default()
    index = PrefixIndex()
    workers = [
        MockerEngine.from_tokenizer(
            tokenizer, worker_id=f"w{n}", block_size=BLOCK_SIZE, cache_blocks=256, tokens="random"
        )
        for n in range(3)
    ]
    for engine in workers:
        engine.kv_events = feed(index, engine.worker_id)

    decisions: list[tuple[str, int, int]] = []
    policy = llm_kv_router(
        index,
        block_size=BLOCK_SIZE,
        seed=0,
        on_decision=lambda worker, hit, miss: decisions.append((worker, hit, miss)),
    )
    router = Router(WorkerSet("decode", {engine.worker_id: engine for engine in workers}), policy)

    for name in ("alice", "bob"):
        prompt = tokenizer.encode(f"{SYSTEM}\nI am {name}.")
        served_by = []
        for question in ("What is a prefix cache?", "Why route by it?", "Thanks!"):
            prompt += tokenizer.encode(question)
            request = PreprocessedRequest(token_ids=prompt, stop=StopConditions(max_tokens=8))
            outputs: list[EngineOutput] = await collect(router, Context.new(request))
            prompt = prompt + [token for output in outputs for token in output.token_ids]
            worker, hit, miss = decisions[-1]
            served_by.append(worker)
            print(f"{name}: {len(request.token_ids)} prompt tokens -> {worker}, "
                  f"{hit} of {hit + miss} blocks cached")  # fmt: skip
        print(f"{name}: every turn on one worker: {len(set(served_by)) == 1}")

    cached = sum(engine.statistics().cached_prompt_tokens for engine in workers)
    computed = sum(engine.statistics().prefill_tokens for engine in workers)
    print(f"prompt tokens found cached: {cached / (cached + computed):.0%}")


if __name__ == "__main__":
    anyio.run(main)
