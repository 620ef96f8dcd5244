"""Migration: a fault at any token leaves the client stream exactly as without the fault."""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.backend import Backend
from operators.contracts.llm import (
    BackendOutput,
    EngineOutput,
    PreprocessedRequest,
)
from operators.migration import Migration
from operators.testing import make_request
from pipeline import (
    ConnectFailed,
    Context,
    EngineError,
    FunctionEngine,
    RoundRobin,
    Router,
    Stream,
    StreamDisconnected,
    WorkerSet,
    link,
)
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context
from tests.helpers.byte_tokenizer import ByteTokenizer

PROMPT = [900, 901, 902]


#: every request here: PROMPT, EOS id 0
request = functools.partial(make_request, token_ids=PROMPT, eos_token_ids=(0,))


class Continuing:
    """A worker that generates ``script`` and honours ``replayed_tokens`` like a real model.

    The first attempt (nothing replayed) dies after ``fail_after`` tokens.
    """

    def __init__(self, script: list[int], fail_after: int | None = None) -> None:
        self.script = script
        self.fail_after = fail_after
        self.requests: list[PreprocessedRequest] = []

    async def generate(self, ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]:
        request = ctx.data
        self.requests.append(request)
        done = request.replayed_tokens
        assert request.token_ids[: request.prompt_tokens] == PROMPT
        assert request.token_ids[request.prompt_tokens :] == self.script[:done]
        budget = request.stop.max_tokens
        first = len(self.requests) == 1
        for count, token_id in enumerate(self.script[done:]):
            if first and count == self.fail_after:
                raise StreamDisconnected("worker died (injected)")
            last = budget is not None and count + 1 >= budget
            yield EngineOutput(
                token_ids=[token_id],
                logprobs=[-token_id / 100],
                finish_reason="length" if last else None,
            )
            if last:
                return
        if first and self.fail_after is not None and self.fail_after >= len(self.script):
            raise StreamDisconnected("worker died at the end (injected)")
        yield EngineOutput(token_ids=[], finish_reason="stop")


def client_view(outputs: list[BackendOutput]) -> tuple[object, ...]:
    """What reaches the client: text, finish, usage, and logprobs of delivered tokens."""
    text = "".join(o.text for o in outputs)
    finishes = [(o.finish_reason, o.stop_reason) for o in outputs if o.finish_reason]
    generated = [i for o in outputs for i in o.token_ids]
    logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
    delivered = outputs[-1].delivered_tokens if outputs else 0
    return text, finishes, len(generated), logprobs[:delivered], delivered


async def serve(
    script: list[int], req: PreprocessedRequest, fail_after: int | None
) -> list[BackendOutput]:
    tok = ByteTokenizer()
    worker = Continuing(script, fail_after)
    graph = link(Migration(limit=3), Backend(tok), worker)
    return await collect(graph, make_context(req))


def tokens_of(tok: ByteTokenizer, text: str, cuts: list[int]) -> list[int]:
    data = text.encode()
    bounds = [0, *cuts, len(data)]
    return tok.tokenize([data[a:b] for a, b in itertools.pairwise(bounds)])


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abzé🥳 ", min_size=1, max_size=16),
    data=st.data(),
)
async def test_every_fault_position_gives_the_fault_free_stream(
    text: str, data: st.DataObject
) -> None:
    raw = text.encode()
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw) - 1)))
    cuts = [c for c in cuts if 0 < c < len(raw)]
    stops = tuple(
        data.draw(st.lists(st.text(alphabet="abzé🥳 ", min_size=1, max_size=4), max_size=3))
    )
    max_tokens = data.draw(st.none() | st.integers(1, len(cuts) + 2))
    tok = ByteTokenizer()
    script = tokens_of(tok, text, cuts)
    req = request(stop=stops, max_tokens=max_tokens)

    async def run(fail_after: int | None) -> list[BackendOutput]:
        worker = Continuing(script, fail_after)
        return await collect(link(Migration(limit=3), Backend(tok), worker), make_context(req))

    reference = client_view(await run(None))
    for k in range(len(script) + 1):
        assert client_view(await run(k)) == reference, f"fault after {k} tokens"


async def test_ozzy_straddling_the_failure_point() -> None:
    tok = ByteTokenizer()
    # Worker A emits "o" under hidden stop "ozzy" and dies; B continues with "there".
    a = Continuing(tok.tokenize([b"o", b"there"]), fail_after=1)
    outputs = await collect(
        link(Migration(), Backend(tok), a), make_context(request(stop=("ozzy",), max_tokens=2))
    )
    assert "".join(o.text for o in outputs) == "othere"
    assert [o.finish_reason for o in outputs if o.finish_reason] == ["length"]
    assert len(a.requests) == 2
    assert a.requests[1].replayed_tokens == 1
    assert a.requests[1].stop.max_tokens == 1
    # The continuation completes the hidden stop: the client sees nothing of it.
    b = Continuing(tok.tokenize([b"o", b"zzy", b"!"]), fail_after=1)
    outputs = await collect(
        link(Migration(), Backend(tok), b), make_context(request(stop=("ozzy",)))
    )
    assert "".join(o.text for o in outputs) == ""
    assert outputs[-1].stop_reason == "ozzy"
    assert sum(len(o.token_ids) for o in outputs) == 2


async def test_retry_across_a_worker_set_with_scripted_workers() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"he", b"llo"])
    dying = ScriptedEngine([EngineOutput(token_ids=[ids[0]])], then=StreamDisconnected("gone"))
    healthy = ScriptedEngine([EngineOutput(token_ids=[ids[1]], finish_reason="stop")])
    workers = WorkerSet("decode", {"a": dying, "b": healthy})
    events: list[tuple[str, str]] = []
    migration = Migration(on_event=lambda where, outcome: events.append((where, outcome)))
    outputs = await collect(
        link(migration, Backend(tok), Router(workers, RoundRobin())), make_context(request())
    )
    assert "".join(o.text for o in outputs) == "hello"
    assert events == [("stream", "retried")]
    retried = healthy.requests[0].data
    assert retried.token_ids == [*PROMPT, ids[0]]
    assert retried.prompt_tokens == len(PROMPT)


async def test_connect_failure_is_retried_and_reported_as_connect() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"ok"])
    workers = WorkerSet(
        "decode",
        {
            "a": ScriptedEngine([], then=ConnectFailed("refused")),
            "b": ScriptedEngine([EngineOutput(token_ids=ids, finish_reason="stop")]),
        },
    )
    events: list[tuple[str, str]] = []
    migration = Migration(on_event=lambda where, outcome: events.append((where, outcome)))
    outputs = await collect(link(migration, Backend(tok), Router(workers)), make_context(request()))
    assert "".join(o.text for o in outputs) == "ok"
    assert events == [("connect", "retried")]


async def test_limit_exhausted_gives_one_clean_error_and_nothing_duplicated() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"a", b"b", b"c", b"d"])

    async def always_dies(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        done = ctx.data.replayed_tokens
        yield EngineOutput(token_ids=[ids[done]])
        raise StreamDisconnected(f"died after token {done}")

    events: list[tuple[str, str]] = []
    graph = link(
        Migration(limit=2, on_event=lambda w, o: events.append((w, o))),
        Backend(tok),
        FunctionEngine(always_dies),
    )
    seen: list[BackendOutput] = []
    with pytest.raises(StreamDisconnected, match="died after token 2"):
        async for output in graph.generate(make_context(request())):
            seen.append(output)
    assert "".join(o.text for o in seen) == "abc"
    assert [i for o in seen for i in o.token_ids] == ids[:3]
    assert all(o.finish_reason is None for o in seen)
    assert events == [("stream", "retried"), ("stream", "retried"), ("stream", "exhausted")]


async def test_an_n_above_one_request_is_sent_again_when_lost_before_its_first_output() -> None:
    # Nothing of it reached the Backend yet: there is no state to rebuild, only a request.
    tok = ByteTokenizer()
    attempts = 0

    async def lost_at_connect(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise ConnectFailed("no worker")
        for index in range(2):
            yield EngineOutput(token_ids=tok.tokenize([b"ok"]), index=index, finish_reason="stop")

    events: list[tuple[str, str]] = []
    graph = link(
        Migration(on_event=lambda w, o: events.append((w, o))), Backend(tok),
        FunctionEngine(lost_at_connect),
    )  # fmt: skip
    seen = await collect(graph, make_context(request(n=2)))
    assert sorted(o.index for o in seen if o.finish_reason) == [0, 1]
    assert attempts == 2
    assert events == [("connect", "retried")]


async def test_never_migrates_n_above_one_once_an_output_went_out() -> None:
    req = request(n=2)
    tok = ByteTokenizer()
    engine = ScriptedEngine(
        [EngineOutput(token_ids=tok.tokenize([b"x"]))], then=StreamDisconnected("gone")
    )
    graph = link(Migration(), Backend(tok), engine)
    with pytest.raises(StreamDisconnected):
        await collect(graph, make_context(req))
    assert len(engine.requests) == 1


async def test_other_errors_pass_through_unchanged() -> None:
    error = EngineError("out of memory")
    engine = ScriptedEngine([], then=error)
    with pytest.raises(EngineError) as raised:
        await collect(link(Migration(), engine), make_context(request()))
    assert raised.value is error
    assert len(engine.requests) == 1


async def test_cancelled_request_is_not_migrated() -> None:
    ctx = make_context(request())

    async def dies_after_stop(c: Context[PreprocessedRequest]) -> AsyncIterator[BackendOutput]:
        ctx.stop_generating()
        raise StreamDisconnected("gone")
        yield  # pragma: no cover

    engine = FunctionEngine(dies_after_stop)
    with pytest.raises(StreamDisconnected):
        await collect(link(Migration(), engine), ctx)


async def test_max_seq_len_disables_migration() -> None:
    engine = ScriptedEngine(
        [BackendOutput(token_ids=[1, 2], tokens=["", ""], text="")], then=StreamDisconnected("x")
    )
    with pytest.raises(StreamDisconnected):
        await collect(link(Migration(max_seq_len=5), engine), make_context(request()))
    assert len(engine.requests) == 1


async def test_migration_passes_check_operator() -> None:
    outputs = [BackendOutput(token_ids=[1], tokens=["a"], text="a")]
    await check_operator(Migration, request(), outputs)
