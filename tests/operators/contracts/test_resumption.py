"""The Migration <-> Backend resumption contract (``operators.contracts.resumption``), in both
orders."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import pytest

from operators.backend import Backend
from operators.contracts.llm import BackendOutput, EngineOutput
from operators.contracts.resumption import RESUMABLE, ResumptionOrderError
from operators.migration import Migration
from operators.testing import make_request
from pipeline import Context, EngineError, LinkError, Router, StreamDisconnected, link
from pipeline.testing import ScriptedEngine, collect, make_context, worker_set
from tests.helpers.byte_tokenizer import ByteTokenizer

PROMPT = [900, 901, 902]


#: every request here: PROMPT, stopping at "ozzy" (and at EOS, id 0)
request = functools.partial(make_request, token_ids=PROMPT, stop=("ozzy",), eos_token_ids=(0,))


def recording(
    outputs: list[Any], seen: list[bool | None], then: BaseException | None = None
) -> ScriptedEngine[Any]:
    """A worker that records RESUMABLE as it stood when its attempt started."""

    def script(ctx: Context[Any]) -> Iterable[Any]:
        seen.append(ctx.state.get(RESUMABLE, None))
        return outputs

    return ScriptedEngine(script, then=then)


async def test_in_order_a_retry_keeps_withheld_text_and_completes_the_hidden_stop() -> None:
    tok = ByteTokenizer()
    seen: list[bool | None] = []
    dying = recording(
        [EngineOutput(token_ids=tok.tokenize([b"o"]))], seen, then=StreamDisconnected("gone")
    )
    rest = [EngineOutput(token_ids=[i]) for i in tok.tokenize([b"zzy", b"tail"])]
    healthy = recording(rest, seen)
    ctx = make_context(request())
    outputs = await collect(
        link(Migration(), Backend(tok), Router(worker_set(dying, healthy))), ctx
    )
    # "o" was withheld through the loss, and "o" + "zzy" is the hidden stop: nothing shows.
    assert "".join(o.text for o in outputs) == ""
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", "ozzy")
    assert seen == [True, True]  # both attempts armed (retries were left)
    assert ctx.state.get(RESUMABLE) is False  # disarmed once the retrier's stream ended


async def test_in_order_with_no_retry_left_the_backend_flushes_before_the_error() -> None:
    tok = ByteTokenizer()
    seen: list[bool | None] = []
    dying = recording(
        [EngineOutput(token_ids=tok.tokenize([b"o"]))], seen, then=StreamDisconnected("gone")
    )
    outputs: list[BackendOutput] = []
    with pytest.raises(StreamDisconnected):
        async for output in link(Migration(limit=0), Backend(tok), dying).generate(
            make_context(request())
        ):
            outputs.append(output)
    assert seen == [False]
    assert "".join(o.text for o in outputs) == "o"
    assert all(o.finish_reason is None for o in outputs)


async def test_backend_before_migration_is_refused_naming_the_right_order() -> None:
    tok = ByteTokenizer()
    engine = ScriptedEngine([EngineOutput(token_ids=tok.tokenize([b"hi"]), finish_reason="stop")])
    graph = link(Backend(tok), Migration(), engine)  # type: ignore[misc]  # mypy refuses it too
    with pytest.raises(ResumptionOrderError) as raised:
        await collect(graph, make_context(request(), id="req-1"))
    message = str(raised.value)
    assert "Migration is linked downstream of Backend (request req-1)" in message
    assert "link(..., Migration(...), Backend(...), ..., engine)" in message
    assert isinstance(raised.value, LinkError)
    assert engine.requests == []  # refused before any attempt reached a worker


async def test_a_retrier_with_no_resumer_below_it_still_retries() -> None:
    first = BackendOutput(token_ids=[1], tokens=["a"], text="a")
    second = BackendOutput(token_ids=[2], tokens=["b"], text="b", finish_reason="stop")
    workers = worker_set(
        ScriptedEngine([first], then=StreamDisconnected("gone")), ScriptedEngine([second])
    )
    outputs = await collect(link(Migration(), Router(workers)), make_context(request()))
    assert [o.text for o in outputs] == ["a", "b"]


@pytest.mark.parametrize("how", ["finish", "error", "close"])
async def test_resumable_is_false_again_however_the_retriers_stream_ends(how: str) -> None:
    outputs = [BackendOutput(token_ids=[i], tokens=["x"], text="x") for i in range(3)]
    then = EngineError("boom") if how == "error" else None
    ctx = make_context(request())
    stream = link(Migration(), ScriptedEngine(outputs, then=then)).generate(ctx)
    await stream.__anext__()
    assert ctx.state.get(RESUMABLE) is True
    if how == "close":
        await stream.aclose()
    else:
        with pytest.raises(EngineError) if then else nullcontext():
            async for _ in stream:
                pass
    assert ctx.state.get(RESUMABLE) is False
