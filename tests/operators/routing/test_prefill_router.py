"""PrefillRouter: the first token from a prefill worker, the rest from decode, each once."""

from __future__ import annotations

import dataclasses
import functools
from contextlib import aclosing
from typing import Any

import anyio
import pytest

from operators.backend import Backend
from operators.contracts.llm import (
    BackendOutput,
    EngineOutput,
    MultimodalItem,
    PreprocessedRequest,
)
from operators.engines.mocker import MockerEngine
from operators.migration import Migration
from operators.routing.encoder_router import EncoderRouter
from operators.routing.prefill_router import PrefillRouter
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer
from pipeline import (
    Context,
    EngineError,
    Router,
    Stream,
    StreamDisconnected,
    WorkerSet,
    link,
    open_stream,
)
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context

FIRST = 41
DECODED = [EngineOutput(token_ids=[42]), EngineOutput(token_ids=[43], finish_reason="length")]

Workers = WorkerSet[PreprocessedRequest, EngineOutput]


#: every request here: a four-token prompt, three tokens to answer, the first two of them
#: past any stop
request = functools.partial(make_request, token_ids=range(100, 104), max_tokens=3, min_tokens=2)


def prefill_worker(
    name: str,
    *,
    finish: str | None = "length",
    handle: object = "default",
    token_ids: list[int] | None = None,
    logprobs: bool = False,
) -> ScriptedEngine[EngineOutput]:
    """A prefill worker: one output with the first token and (by default) a handle."""

    def script(ctx: Context[PreprocessedRequest]) -> list[EngineOutput]:
        result = {"worker_id": name, "request_id": ctx.id} if handle == "default" else handle
        return [
            EngineOutput(
                token_ids=[FIRST] if token_ids is None else token_ids,
                logprobs=[-0.5] if logprobs else None,
                top_logprobs=[[(FIRST, -0.5), (7, -1.5)]] if logprobs else None,
                finish_reason=finish,  # type: ignore[arg-type]
                prefill_result=result,  # type: ignore[arg-type]
            )
        ]

    return ScriptedEngine(script)


def workers(**engines: ScriptedEngine[EngineOutput]) -> Workers:
    return WorkerSet("prefill", engines)


async def serve(
    router: PrefillRouter, req: PreprocessedRequest, ctx_id: str = "req"
) -> tuple[list[EngineOutput], ScriptedEngine[EngineOutput]]:
    decode: ScriptedEngine[EngineOutput] = ScriptedEngine(DECODED)
    outputs = await collect(link(router, decode), make_context(req, id=ctx_id))
    return outputs, decode


def prefilled_by(decode: ScriptedEngine[EngineOutput]) -> list[Any]:
    return [
        None if ctx.data.prefill_result is None else ctx.data.prefill_result["worker_id"]
        for ctx in decode.requests
    ]


# ------------------------------------------------------------------------ aggregated


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: PrefillRouter(), id="no-worker-set"),
        pytest.param(lambda: PrefillRouter(workers()), id="empty-worker-set"),
    ],
)
async def test_aggregated_without_prefill_workers(make: Any) -> None:
    router = make()
    outputs, decode = await serve(router, request())
    assert outputs == DECODED
    assert decode.requests[0].data == request()
    assert router.state == "pending"


async def test_conditional_disaggregation_by_prompt_length() -> None:
    p1 = prefill_worker("p1")
    router = PrefillRouter(workers(p1=p1), min_prompt_tokens=8)
    outputs, decode = await serve(router, request(token_ids=range(100, 107)))
    assert outputs == DECODED
    assert prefilled_by(decode) == [None]
    assert p1.requests == []
    outputs, decode = await serve(router, request(token_ids=range(100, 108)))
    assert prefilled_by(decode) == ["p1"]
    assert len(outputs) == 3


async def test_aggregated_for_n_choices_and_for_requests_with_a_handle() -> None:
    p1 = prefill_worker("p1")
    router = PrefillRouter(workers(p1=p1))
    _, decode = await serve(router, request(n=2))
    assert decode.requests[0].data == request(n=2)
    handed = dataclasses.replace(request(), prefill_result={"worker_id": "elsewhere"})
    _, decode = await serve(router, handed)
    assert decode.requests[0].data == handed
    assert p1.requests == []


def test_rejects_a_negative_threshold() -> None:
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        PrefillRouter(min_prompt_tokens=-1)


# ------------------------------------------------------------------------ disaggregated


async def test_prefill_leg_then_decode_with_the_handle() -> None:
    p1 = prefill_worker("p1")
    router = PrefillRouter(workers(p1=p1))
    outputs, decode = await serve(router, request(), ctx_id="r1")

    [leg] = p1.requests
    assert leg.id == "r1"
    assert leg.data.stop.max_tokens == 1
    assert leg.data.stop.min_tokens == 1  # min_tokens=2: its first token may not stop it
    assert leg.data.prefill_result is None
    assert leg.data.token_ids == request().token_ids

    [sent] = decode.requests
    assert sent.id == "r1"
    assert sent.data == dataclasses.replace(
        request(), prefill_result={"worker_id": "p1", "request_id": "r1"}
    )  # original max_tokens/min_tokens and token_ids

    # the first token once (from prefill, not terminal, no handle), then decode's
    assert outputs == [EngineOutput(token_ids=[FIRST]), *DECODED]
    assert p1.open_streams == 0
    assert router.workers is not None
    assert router.workers.statistics().in_flight == 0


async def test_first_token_keeps_its_logprobs() -> None:
    router = PrefillRouter(workers(p1=prefill_worker("p1", logprobs=True)))
    outputs, _ = await serve(router, request())
    assert outputs[0] == EngineOutput(
        token_ids=[FIRST], logprobs=[-0.5], top_logprobs=[[(FIRST, -0.5), (7, -1.5)]]
    )


async def test_round_robin_over_prefill_workers() -> None:
    router = PrefillRouter(workers(p1=prefill_worker("p1"), p2=prefill_worker("p2")))
    seen = []
    for _ in range(4):
        _, decode = await serve(router, request())
        seen += prefilled_by(decode)
    assert seen == ["p1", "p2", "p1", "p2"]


async def test_membership_changes_while_requests_run() -> None:
    pool = workers(p1=prefill_worker("p1"), p2=prefill_worker("p2"))
    router = PrefillRouter(pool)
    hanging_decode = ScriptedEngine(DECODED[:1], then="hang")
    ctx = make_context(request(), id="in-flight")
    seen: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, link(router, hanging_decode), ctx)
        await hanging_decode.hanging.wait()  # prefilled on p1, now decoding
        pool.remove("p1")
        pool.add("p3", prefill_worker("p3"))
        for _ in range(4):
            _, decode = await serve(router, request())
            seen += prefilled_by(decode)
        ctx.stop_generating()
    assert prefilled_by(hanging_decode) == ["p1"]
    assert "p1" not in seen
    assert sorted(seen) == ["p2", "p2", "p3", "p3"]
    assert seen[0] != seen[1]
    pool.remove("p2")
    pool.remove("p3")
    assert router.state == "unavailable"
    _, decode = await serve(router, request())
    assert prefilled_by(decode) == [None]  # back to aggregated


async def test_a_terminal_first_token_is_the_whole_answer() -> None:
    router = PrefillRouter(workers(p1=prefill_worker("p1", finish="stop")))
    outputs, decode = await serve(router, request(min_tokens=0))  # EOS as the first token
    assert outputs == [EngineOutput(token_ids=[FIRST], finish_reason="stop")]
    assert decode.requests == []

    router = PrefillRouter(workers(p1=prefill_worker("p1")))
    outputs, decode = await serve(router, request(max_tokens=1, min_tokens=0))
    assert outputs == [EngineOutput(token_ids=[FIRST], finish_reason="length")]
    assert decode.requests == []


async def test_a_stop_within_min_tokens_does_not_end_the_request() -> None:
    router = PrefillRouter(workers(p1=prefill_worker("p1", finish="stop")))
    outputs, decode = await serve(router, request(min_tokens=2))
    assert outputs == [EngineOutput(token_ids=[FIRST]), *DECODED]
    assert prefilled_by(decode) == ["p1"]


async def test_max_tokens_zero_is_served_aggregated() -> None:
    p1 = prefill_worker("p1")
    _, decode = await serve(PrefillRouter(workers(p1=p1)), request(max_tokens=0))
    assert prefilled_by(decode) == [None]
    assert p1.requests == []


@pytest.mark.parametrize(
    ("handle", "message"),
    [
        pytest.param(None, "NoneType", id="missing"),
        pytest.param(["a", "list"], "list", id="list"),
        pytest.param("a string", "str", id="string"),
    ],
)
async def test_a_prefill_without_an_object_handle_fails_loudly(
    handle: object, message: str
) -> None:
    router = PrefillRouter(workers(p1=prefill_worker("p1", handle=handle)))
    with pytest.raises(EngineError, match=f"no transfer handle.*{message}"):
        await serve(router, request())


@pytest.mark.parametrize("token_ids", [[], [FIRST, FIRST + 1]])
async def test_a_prefill_must_return_exactly_one_token(token_ids: list[int]) -> None:
    router = PrefillRouter(workers(p1=prefill_worker("p1", token_ids=token_ids)))
    with pytest.raises(EngineError, match=f"returned {len(token_ids)} tokens"):
        await serve(router, request())


# ------------------------------------------------------------------ errors, cancellation


@pytest.mark.parametrize(
    "error",
    [StreamDisconnected("prefill worker died"), EngineError("prefill failed")],
    ids=["worker-lost", "engine-error"],
)
async def test_prefill_errors_propagate_unchanged(error: Exception) -> None:
    router = PrefillRouter(workers(p1=ScriptedEngine([], then=error)))
    with pytest.raises(type(error)) as caught:
        await serve(router, request())
    assert caught.value is error


async def test_kill_during_prefill_reaches_the_leg() -> None:
    slow: ScriptedEngine[EngineOutput] = ScriptedEngine([], then="hang")
    router = PrefillRouter(workers(slow=slow))
    decode = ScriptedEngine(DECODED)
    ctx = make_context(request())
    async with anyio.create_task_group() as tg:

        async def kill_when_hanging() -> None:
            await slow.hanging.wait()
            ctx.kill()

        tg.start_soon(kill_when_hanging)
        assert await collect(link(router, decode), ctx) == []
    [leg] = slow.requests
    assert leg.is_killed
    assert leg is not ctx
    assert slow.open_streams == 0
    assert decode.requests == []


async def test_stop_during_prefill_ends_quietly() -> None:
    slow: ScriptedEngine[EngineOutput] = ScriptedEngine([], then="hang")
    router = PrefillRouter(workers(slow=slow))
    decode = ScriptedEngine(DECODED)
    ctx = make_context(request())
    async with anyio.create_task_group() as tg:

        async def stop_when_hanging() -> None:
            await slow.hanging.wait()
            ctx.stop_generating()

        tg.start_soon(stop_when_hanging)
        assert await collect(link(router, decode), ctx) == []
    assert slow.requests[0].is_stopped
    assert decode.requests == []


async def test_consumer_stopping_after_the_first_token_closes_decode() -> None:
    router = PrefillRouter(workers(p1=prefill_worker("p1")))
    decode = ScriptedEngine(DECODED, then="hang")
    async with open_stream(link(router, decode), make_context(request())) as stream:
        async for output in stream:
            assert output.token_ids == [FIRST]
            break
    assert decode.open_streams == 0


async def test_check_operator_without_prefill_workers() -> None:
    await check_operator(lambda: PrefillRouter(), request(), DECODED)
    await check_operator(lambda: PrefillRouter(workers()), request(), DECODED)


async def test_check_operator_with_prefill_workers() -> None:
    pool = workers(p1=prefill_worker("p1"), p2=prefill_worker("p2"))
    await check_operator(lambda: PrefillRouter(pool), request(), DECODED)
    await check_operator(lambda: PrefillRouter(pool, min_prompt_tokens=100), request(), DECODED)
    assert pool.statistics().in_flight == 0


# ------------------------------------------------------------------- the whole graph

IMAGE = MultimodalItem(kind="image", data=b"\x89PNG a cat", mime_type="image/png")
TIMING = {"prefill_ms_per_token": 0.01, "decode_ms_per_step": 0.2}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


def chat_request(tokenizer: Tokenizer, *, logprobs: int | None = 1) -> PreprocessedRequest:
    """A request about a picture, in real tokens, stopping at the tokenizer's EOS."""
    return make_request(
        tokenizer.encode("Describe the picture: a cat asleep on a warm windowsill."),
        max_tokens=24,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        logprobs=logprobs,
        multimodal=(IMAGE,),
    )


def mocker(tokenizer: Tokenizer, role: str, worker_id: str, **options: Any) -> MockerEngine:
    return MockerEngine.from_tokenizer(
        tokenizer, role=role, worker_id=worker_id, **{**TIMING, **options}
    )


class Recording:
    """Wraps a worker and records which requests reached it."""

    def __init__(self, engine: MockerEngine) -> None:
        self.engine = engine
        self.requests: list[PreprocessedRequest] = []

    async def generate(self, ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]:
        self.requests.append(ctx.data)
        async with aclosing(self.engine.generate(ctx)) as stream:
            async for output in stream:
                yield output


class FlakyOnce:
    """A worker whose first request is lost before it produces anything."""

    def __init__(self, engine: MockerEngine) -> None:
        self.engine = engine
        self.failed = False

    async def generate(self, ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]:
        if not self.failed:
            self.failed = True
            raise StreamDisconnected("prefill worker lost (injected)")
        async with aclosing(self.engine.generate(ctx)) as stream:
            async for output in stream:
                yield output


def summary(outputs: list[BackendOutput]) -> tuple[list[int], str, list[float], list[object]]:
    return (
        [t for out in outputs for t in out.token_ids],
        "".join(out.text for out in outputs),
        [lp for out in outputs for lp in out.logprobs or []],
        [out.finish_reason for out in outputs if out.finish_reason is not None],
    )


async def aggregated_answer(tokenizer: Tokenizer, req: PreprocessedRequest, **options: Any) -> Any:
    agg: Workers = WorkerSet("aggregated", {"a1": mocker(tokenizer, "aggregated", "a1", **options)})
    graph = link(Migration(), Backend(tokenizer), Router(agg))
    return summary(await collect(graph, make_context(req)))


@pytest.mark.parametrize("tokens", ["echo", "random"])
async def test_disaggregated_graph_answers_like_the_aggregated_one(
    tokenizer: Tokenizer, tokens: str
) -> None:
    req = chat_request(tokenizer)
    encode = Recording(mocker(tokenizer, "encode", "e1", tokens=tokens))
    prefill = Recording(mocker(tokenizer, "prefill", "p1", tokens=tokens))
    decode = Recording(mocker(tokenizer, "decode", "d1", tokens=tokens))
    graph = link(
        Migration(),
        Backend(tokenizer),
        EncoderRouter(WorkerSet("encode", {"e1": encode})),
        PrefillRouter(WorkerSet("prefill", {"p1": prefill})),
        Router(WorkerSet("decode", {"d1": decode})),
    )
    answer = summary(await collect(graph, make_context(req)))
    expected = await aggregated_answer(tokenizer, req, tokens=tokens)
    assert answer == expected
    ids, text, logprobs, finishes = answer
    assert len(ids) == 24
    assert len(logprobs) == 24
    assert text
    assert finishes == ["length"]
    # every role served: encode -> prefill (with the encoder's result) -> decode (handle)
    assert len(encode.requests) == 1
    [prefilled] = prefill.requests
    assert prefilled.encoder_result is not None
    assert prefilled.encoder_result["worker_id"] == "e1"
    [decoded] = decode.requests
    assert decoded.prefill_result is not None
    assert decoded.prefill_result["worker_id"] == "p1"
    assert decoded.token_ids == req.token_ids


async def test_disaggregated_graph_survives_lost_workers(tokenizer: Tokenizer) -> None:
    """A decode worker lost mid-stream and a prefill worker lost at once: same answer."""
    req = chat_request(tokenizer)
    prefill = FlakyOnce(mocker(tokenizer, "prefill", "p1"))
    decode = Recording(mocker(tokenizer, "decode", "d1", fail_after_tokens=5))
    graph = link(
        Migration(),
        Backend(tokenizer),
        EncoderRouter(WorkerSet("encode", {"e1": mocker(tokenizer, "encode", "e1")})),
        PrefillRouter(WorkerSet("prefill", {"p1": prefill})),
        Router(WorkerSet("decode", {"d1": decode})),
    )
    answer = summary(await collect(graph, make_context(req)))
    assert prefill.failed
    assert answer == await aggregated_answer(tokenizer, req)
    # attempt 1: prefill lost; attempt 2: first token + 5 decoded, then decode lost;
    # attempt 3 continues after those 6 tokens (prefill of the 7th, decode of the rest)
    assert [r.replayed_tokens for r in decode.requests] == [0, 6]
    assert decode.requests[1].token_ids[: len(req.token_ids)] == req.token_ids


async def test_without_disaggregation_workers_the_graph_serves_aggregated(
    tokenizer: Tokenizer,
) -> None:
    req = chat_request(tokenizer, logprobs=None)
    graph = link(
        Migration(),
        Backend(tokenizer),
        EncoderRouter(WorkerSet("encode")),
        PrefillRouter(WorkerSet("prefill")),
        Router(WorkerSet("decode", {"d1": mocker(tokenizer, "decode", "d1")})),
    )
    answer = summary(await collect(graph, make_context(req)))
    assert answer == await aggregated_answer(tokenizer, req)
