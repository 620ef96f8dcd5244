"""Disaggregated serving in one process: encode, prefill and decode on separate workers.

The graph (each hop a small operator; each worker a simulated :class:`MockerEngine`)::

    Migration -> Backend -> EncoderRouter --(images)--> encode worker e1
                                |
                          PrefillRouter --(max_tokens=1)--> prefill worker p1
                                |                          (first token + transfer handle)
                          Router(decode) ---------------> decode worker d1
                                                           (tokens 2..n, with the handle)

The same request through an aggregated graph (one worker does everything) gives the same
tokens and the same text: disaggregation changes who does the work and when, not what.

Run it: ``python examples/disaggregated.py``.
"""

from __future__ import annotations

from contextlib import aclosing

import anyio

from operators.backend import Backend
from operators.contracts.llm import (
    BackendOutput,
    EngineOutput,
    MultimodalItem,
    PreprocessedRequest,
    StopConditions,
)
from operators.engines.mocker import MockerEngine, Role
from operators.migration import Migration
from operators.routing.encoder_router import EncoderRouter
from operators.routing.prefill_router import PrefillRouter
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, Router, Stream, WorkerSet, link
from pipeline.testing import collect

Workers = WorkerSet[PreprocessedRequest, EngineOutput]


class Served:
    """Wraps a worker's engine and notes each request it serves (a user-written Engine)."""

    def __init__(self, engine: Engine[PreprocessedRequest, EngineOutput], log: list[str]) -> None:
        self._engine = engine
        self._log = log
        self._name = getattr(engine, "worker_id", "?")

    async def generate(self, ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]:
        role = getattr(self._engine, "role", "worker")
        self._log.append(f"{role} {self._name}")
        async with aclosing(self._engine.generate(ctx)) as stream:
            async for output in stream:
                yield output


def worker(tokenizer: Tokenizer, role: Role, worker_id: str, log: list[str]) -> Served:
    mocker = MockerEngine.from_tokenizer(
        tokenizer,
        role=role,
        worker_id=worker_id,
        prefill_ms_per_token=0.05,
        decode_ms_per_step=2.0,
    )
    return Served(mocker, log)


async def answer(
    graph: Engine[PreprocessedRequest, BackendOutput], request: PreprocessedRequest
) -> tuple[list[int], str]:
    """The token ids and the text the graph returns for ``request``."""
    outputs = await collect(graph, Context.new(request))
    return [t for out in outputs for t in out.token_ids], "".join(out.text for out in outputs)


async def main() -> None:
    tokenizer = Tokenizer.default()
    request = PreprocessedRequest(
        token_ids=tokenizer.encode("What is in this picture? Describe it in one sentence."),
        stop=StopConditions(max_tokens=12, eos_token_ids=tuple(sorted(tokenizer.eos_token_ids))),
        multimodal=(MultimodalItem(kind="image", data=b"\x89PNG...", mime_type="image/png"),),
    )

    served: list[str] = []
    encode: Workers = WorkerSet("encode", {"e1": worker(tokenizer, "encode", "e1", served)})
    prefill: Workers = WorkerSet("prefill", {"p1": worker(tokenizer, "prefill", "p1", served)})
    decode: Workers = WorkerSet("decode", {"d1": worker(tokenizer, "decode", "d1", served)})
    disaggregated = link(
        Migration(),
        Backend(tokenizer),
        EncoderRouter(encode),
        PrefillRouter(prefill),
        Router(decode),
    )
    ids, text = await answer(disaggregated, request)
    print(f"disaggregated: {text!r} ({len(ids)} tokens)")
    print(f"served by: {', '.join(served)}")

    aggregated_log: list[str] = []
    single: Workers = WorkerSet(
        "aggregated", {"a1": worker(tokenizer, "aggregated", "a1", aggregated_log)}
    )
    aggregated = link(Migration(), Backend(tokenizer), Router(single))
    same = await answer(aggregated, request) == (ids, text)
    print(f"aggregated ({', '.join(aggregated_log)}) gives the same answer: {same}")


if __name__ == "__main__":
    anyio.run(main)
