"""PrefillRouter with a KvRouter: a prompt is prefilled where its prefix is cached."""

from __future__ import annotations

from operators.contracts.llm import EngineOutput, PreprocessedRequest, StopConditions
from operators.engines.mocker import MockerEngine
from operators.routing.kv_blocks import request_block_ids
from operators.routing.prefill_router import PrefillRouter
from pipeline import Context, KvEvent, KvRouter, PrefixIndex, RoutingPolicy, WorkerSet, link
from pipeline.testing import collect

BLOCK = 4


def prefill_workers(index: PrefixIndex, count: int = 3) -> list[MockerEngine]:
    engines = [
        MockerEngine(
            worker_id=f"p{number}",
            role="prefill",
            prefill_ms_per_token=0,
            decode_ms_per_step=0,
            block_size=BLOCK,
            cache_blocks=64,
        )
        for number in range(count)
    ]
    for engine in engines:
        engine.kv_events = lambda event, worker=engine.worker_id: _apply(index, worker, event)
    return engines


def _apply(index: PrefixIndex, worker: str, event: KvEvent) -> None:
    assert index.apply(worker, event)


async def serve(
    policy: RoutingPolicy | None, engines: list[MockerEngine], prompts: list[list[int]]
) -> list[int | None]:
    """Serve each prompt in turn; the prompt tokens each one found cached, as reported."""
    router = PrefillRouter(
        WorkerSet[PreprocessedRequest, EngineOutput](
            "prefill", {engine.worker_id: engine for engine in engines}
        ),
        policy=policy,
    )
    decode = MockerEngine(role="decode", prefill_ms_per_token=0, decode_ms_per_step=0)
    graph = link(router, decode)
    reported = []
    for prompt in prompts:
        request = PreprocessedRequest(token_ids=prompt, stop=StopConditions(max_tokens=3))
        outputs = await collect(graph, Context.new(request))
        assert sum(len(output.token_ids) for output in outputs) == 3
        reported.append(outputs[0].cached_tokens)  # the prefill leg's, on the first token
    return reported


def cached(engines: list[MockerEngine]) -> dict[str, int]:
    return {engine.worker_id: engine.statistics().cached_prompt_tokens for engine in engines}


async def test_a_longer_prompt_is_prefilled_on_the_worker_caching_its_prefix() -> None:
    index = PrefixIndex()
    engines = prefill_workers(index)
    conversation = list(range(1000, 1032))  # 8 full blocks
    other = list(range(2000, 2032))
    policy = KvRouter(index, request_block_ids(BLOCK), seed=0)
    reported = await serve(
        policy, engines, [conversation, other, conversation + [7] * 8, other + [9] * 8]
    )
    assert reported == [0, 0, 32, 32]
    found = cached(engines)
    # each second turn found its whole first turn (32 tokens) cached: it was prefilled on
    # the worker that prefilled the first
    assert sum(found.values()) == 64


async def test_round_robin_prefill_finds_no_prefix() -> None:
    index = PrefixIndex()
    engines = prefill_workers(index)
    conversation = list(range(1000, 1032))
    await serve(None, engines, [conversation, conversation + [7] * 8])
    assert sum(cached(engines).values()) == 0
