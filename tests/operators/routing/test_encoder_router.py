"""EncoderRouter: images go to an encode worker first; any encode failure falls back inline."""

from __future__ import annotations

import functools
import logging
from typing import Any

import anyio
import pytest

from operators.contracts.llm import (
    EngineOutput,
    MultimodalItem,
    PreprocessedRequest,
)
from operators.routing.encoder_router import EncoderRouter
from operators.testing import make_request
from pipeline import EngineError, StreamDisconnected, WorkerSet, link
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context

IMAGE = MultimodalItem(kind="image", data=b"\x89PNG fake", mime_type="image/png")
ANSWER = [EngineOutput(token_ids=[7]), EngineOutput(token_ids=[8], finish_reason="length")]

Workers = WorkerSet[PreprocessedRequest, EngineOutput]


#: every request here: one image, unless it says otherwise
request = functools.partial(make_request, max_tokens=2, multimodal=(IMAGE,))


def encoder(name: str, result: object = None) -> ScriptedEngine[EngineOutput]:
    """An encode worker whose terminal carries ``result`` (default: {"worker_id": name})."""
    return ScriptedEngine(
        [
            EngineOutput(
                token_ids=[],
                finish_reason="stop",
                encoder_result={"worker_id": name} if result is None else result,  # type: ignore[arg-type]
            )
        ]
    )


def workers(**engines: ScriptedEngine[EngineOutput]) -> Workers:
    return WorkerSet("encode", engines)


async def serve(
    router: EncoderRouter, req: PreprocessedRequest
) -> tuple[list[EngineOutput], ScriptedEngine[EngineOutput]]:
    downstream: ScriptedEngine[EngineOutput] = ScriptedEngine(ANSWER)
    outputs = await collect(link(router, downstream), make_context(req))
    return outputs, downstream


def encoded_by(downstream: ScriptedEngine[EngineOutput]) -> list[Any]:
    return [
        None if ctx.data.encoder_result is None else ctx.data.encoder_result.get("worker_id")
        for ctx in downstream.requests
    ]


# ------------------------------------------------------------------------ passthrough


@pytest.mark.parametrize(
    "router",
    [
        pytest.param(lambda: EncoderRouter(), id="no-worker-set"),
        pytest.param(lambda: EncoderRouter(workers()), id="empty-worker-set"),
    ],
)
async def test_passthrough_without_encode_workers(router: Any) -> None:
    router = router()
    outputs, downstream = await serve(router, request())
    assert outputs == ANSWER
    assert downstream.requests[0].data == request()
    assert router.state == "pending"


async def test_passthrough_for_text_only_and_already_encoded_requests() -> None:
    e1 = encoder("e1")
    router = EncoderRouter(workers(e1=e1))
    _, downstream = await serve(router, request(multimodal=()))
    assert downstream.requests[0].data == request(multimodal=())
    _, downstream = await serve(router, request(encoder_result={"done": True}))
    assert downstream.requests[0].data.encoder_result == {"done": True}
    assert e1.requests == []


# ---------------------------------------------------------------------------- encoding


async def test_attaches_the_encode_workers_result_and_continues_downstream() -> None:
    e1 = encoder("e1")
    router = EncoderRouter(workers(e1=e1))
    ctx = make_context(request(), id="r1")
    downstream = ScriptedEngine(ANSWER)
    outputs = await collect(link(router, downstream), ctx)
    assert outputs == ANSWER
    [leg] = e1.requests
    assert leg.id == "r1"
    assert leg.data == request()  # the encode worker sees the request as it came
    leg.kill()  # a child leg: its cancellation never reaches the request
    assert not ctx.is_killed
    [sent] = downstream.requests
    assert sent.id == "r1"
    assert sent.data.encoder_result == {"worker_id": "e1"}
    assert sent.data.multimodal == (IMAGE,)
    assert e1.open_streams == 0


async def test_round_robin_over_encode_workers() -> None:
    router = EncoderRouter(workers(e1=encoder("e1"), e2=encoder("e2")))
    seen = []
    for _ in range(4):
        _, downstream = await serve(router, request())
        seen += encoded_by(downstream)
    assert seen == ["e1", "e2", "e1", "e2"]


async def test_membership_changes_while_requests_run() -> None:
    pool = workers(e1=encoder("e1"), e2=encoder("e2"))
    router = EncoderRouter(pool)
    hanging = ScriptedEngine(ANSWER[:1], then="hang")
    ctx = make_context(request(), id="in-flight")
    seen: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, link(router, hanging), ctx)
        await hanging.hanging.wait()  # encoded by e1, now decoding downstream
        pool.remove("e1")
        pool.add("e3", encoder("e3"))
        for _ in range(4):
            _, downstream = await serve(router, request())
            seen += encoded_by(downstream)
        ctx.stop_generating()
    assert encoded_by(hanging) == ["e1"]
    assert "e1" not in seen
    assert sorted(seen) == ["e2", "e2", "e3", "e3"]
    assert seen[0] != seen[1]


async def test_lifecycle_follows_membership() -> None:
    pool = workers()
    router = EncoderRouter(pool)
    states = [router.state]
    pool.add("e1", encoder("e1"))
    states.append(router.state)
    pool.remove("e1")
    states.append(router.state)
    _, downstream = await serve(router, request())  # unavailable: passthrough
    assert encoded_by(downstream) == [None]
    pool.add("e2", encoder("e2"))
    states.append(router.state)
    assert states == ["pending", "active", "unavailable", "active"]
    _, downstream = await serve(router, request())
    assert encoded_by(downstream) == ["e2"]


# --------------------------------------------------------------------------- fallback


def failing(error: Exception) -> ScriptedEngine[EngineOutput]:
    return ScriptedEngine([], then=error)


@pytest.mark.parametrize(
    ("worker", "logged"),
    [
        pytest.param(failing(EngineError("encoder OOM")), "encoder OOM", id="engine-error"),
        pytest.param(failing(StreamDisconnected("gone")), "gone", id="worker-lost"),
        pytest.param(failing(RuntimeError("bug")), "bug", id="foreign-error"),
        pytest.param(
            ScriptedEngine([EngineOutput(token_ids=[], finish_reason="stop")]),
            "NoneType, not an object",
            id="terminal-without-result",
        ),
        pytest.param(encoder("e", ["a", "list"]), "list, not an object", id="list-result"),
        pytest.param(encoder("e", "a string"), "str, not an object", id="string-result"),
        pytest.param(ScriptedEngine([EngineOutput(token_ids=[])]), "no terminal", id="no-terminal"),
    ],
)
async def test_encode_failure_falls_back_to_inline_encoding(
    worker: ScriptedEngine[EngineOutput], logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    router = EncoderRouter(workers(bad=worker))
    with caplog.at_level(logging.WARNING, logger="operators.routing.encoder_router"):
        outputs, downstream = await serve(router, request())
    assert outputs == ANSWER
    [sent] = downstream.requests
    assert sent.data == request()  # unchanged: the downstream worker encodes inline
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "inline encoding" in record.getMessage()
    assert logged in record.getMessage()
    assert worker.open_streams == 0


# ----------------------------------------------------------------------- cancellation


async def test_kill_during_encode_reaches_the_leg_and_skips_downstream() -> None:
    slow: ScriptedEngine[EngineOutput] = ScriptedEngine([], then="hang")
    router = EncoderRouter(workers(slow=slow))
    downstream = ScriptedEngine(ANSWER)
    ctx = make_context(request())
    async with anyio.create_task_group() as tg:

        async def kill_when_hanging() -> None:
            await slow.hanging.wait()
            ctx.kill()

        tg.start_soon(kill_when_hanging)
        assert await collect(link(router, downstream), ctx) == []
    [leg] = slow.requests
    assert leg.is_killed
    assert downstream.requests == []
    assert slow.open_streams == 0


async def test_stop_during_encode_is_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    slow: ScriptedEngine[EngineOutput] = ScriptedEngine([], then="hang")
    router = EncoderRouter(workers(slow=slow))
    downstream = ScriptedEngine(ANSWER)
    ctx = make_context(request())
    with caplog.at_level(logging.WARNING, logger="operators.routing.encoder_router"):
        async with anyio.create_task_group() as tg:

            async def stop_when_hanging() -> None:
                await slow.hanging.wait()
                ctx.stop_generating()

            tg.start_soon(stop_when_hanging)
            assert await collect(link(router, downstream), ctx) == []
    assert caplog.records == []
    assert slow.open_streams == 0


# ------------------------------------------------------------------------ conformance


async def test_check_operator_without_encode_workers() -> None:
    await check_operator(lambda: EncoderRouter(), request(), ANSWER)
    await check_operator(lambda: EncoderRouter(workers()), request(), ANSWER)


async def test_check_operator_with_encode_workers() -> None:
    pool = workers(e1=encoder("e1"), e2=encoder("e2"))
    await check_operator(lambda: EncoderRouter(pool), request(), ANSWER)
    await check_operator(lambda: EncoderRouter(pool), request(multimodal=()), ANSWER)
    assert pool.statistics().in_flight == 0
