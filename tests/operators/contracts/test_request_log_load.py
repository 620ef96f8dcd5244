"""A worker's ``RequestLog`` keeps its load for a planner: requests waiting for their first
output (and their prompt tokens), requests decoding, and a call whenever that changes."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from operators.contracts.llm import EngineOutput
from operators.contracts.transport import RequestLog
from operators.testing import make_request
from pipeline import Context, EngineError, FunctionEngine, link, open_stream
from pipeline.testing import make_context


async def test_the_load_follows_each_request_from_arrival_to_end() -> None:
    first, rest = anyio.Event(), anyio.Event()

    async def engine(ctx: Context[object]):  # type: ignore[no-untyped-def]
        await first.wait()
        yield EngineOutput(token_ids=[1])
        await rest.wait()
        yield EngineOutput(token_ids=[2], finish_reason="length")

    log = RequestLog("w")
    seen: list[dict[str, int]] = []
    arrived = anyio.Event()

    def changed() -> None:
        seen.append(log.load())
        arrived.set()

    log.on_change = changed
    graph = link(log, FunctionEngine(engine))
    ctx = make_context(make_request(token_ids=[5, 6, 7]))
    async with open_stream(graph, ctx) as stream:
        outputs = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _read(stream, outputs))
            await arrived.wait()
            assert log.load() == {"waiting": 1, "decoding": 0, "prefill": 3}
            first.set()
        assert log.load() == {"waiting": 0, "decoding": 1, "prefill": 0}
        rest.set()
        await _read(stream, outputs)
    assert outputs == [EngineOutput([1]), EngineOutput([2], finish_reason="length")]
    assert log.load() == {"waiting": 0, "decoding": 0, "prefill": 0}
    assert seen == [
        {"waiting": 1, "decoding": 0, "prefill": 3},
        {"waiting": 0, "decoding": 1, "prefill": 0},
        {"waiting": 0, "decoding": 0, "prefill": 0},
    ]


async def test_a_request_that_fails_before_its_first_output_leaves_no_load() -> None:
    async def engine(ctx: Context[object]):  # type: ignore[no-untyped-def]
        raise EngineError("no")
        yield  # (a generator)

    log = RequestLog("w")
    with pytest.raises(EngineError):
        async with open_stream(
            link(log, FunctionEngine(engine)), make_context(make_request())
        ) as s:
            await anext(s)
    assert log.load() == {"waiting": 0, "decoding": 0, "prefill": 0}
    assert log.in_flight == 0


async def _read(stream, into: list[object]) -> None:  # type: ignore[no-untyped-def]
    into.append(await anext(stream))
