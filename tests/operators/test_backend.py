"""The Backend operator: every invariant of DESIGN.md §3 on every terminal path."""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators.backend import RESUMABLE, Backend
from operators.contracts.llm import BackendOutput, EngineOutput, PreprocessedRequest
from operators.testing import make_request
from operators.text.stop_jail import find_stop
from operators.text.tokenizer import Tokenizer
from pipeline import Context, EngineError, FunctionEngine, StreamDisconnected, link
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context
from tests.helpers.byte_tokenizer import ByteTokenizer, reference_text

EOS = ByteTokenizer.EOS


#: every request here: a three-token prompt, EOS as the tokenizer's end
request = functools.partial(make_request, token_ids=[7, 8, 9], eos_token_ids=(EOS,))


def outputs_for(ids: list[int], *, finish: str | None = None, index: int = 0) -> list[EngineOutput]:
    outs = [EngineOutput(token_ids=[i], logprobs=[-float(i)], index=index) for i in ids]
    if finish is not None and outs:
        outs[-1].finish_reason = finish  # type: ignore[assignment]
    return outs


async def run(
    tok: ByteTokenizer,
    req: PreprocessedRequest,
    outs: list[EngineOutput],
    then: BaseException | None = None,
) -> list[BackendOutput]:
    return await collect(link(Backend(tok), ScriptedEngine(outs, then=then)), make_context(req))


def joined(outputs: list[BackendOutput], index: int = 0) -> str:
    return "".join(o.text for o in outputs if o.index == index)


def check_alignment(tok: ByteTokenizer, outputs: list[BackendOutput]) -> None:
    """tokens[i] is the text of token_ids[i]: concatenated they decode the generated ids."""
    for index in {o.index for o in outputs}:
        mine = [o for o in outputs if o.index == index]
        ids = [i for o in mine for i in o.token_ids]
        for o in mine:
            assert len(o.tokens) == len(o.token_ids)
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.token_ids)
                assert o.logprobs == [-float(i) for i in o.token_ids]
        assert "".join(t for o in mine for t in o.tokens) == tok.decode([i for i in ids if i > 1])
        finishes = [o.finish_reason for o in mine if o.finish_reason is not None]
        assert len(finishes) <= 1
        delivered = [o.delivered_tokens for o in mine]
        assert delivered == sorted(delivered)
        assert not any("\ufffd" in o.text for o in mine)


# --- the three scenarios of seeds/000 -------------------------------------------------------


async def test_split_hidden_stop_never_leaks() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b" alpha", b" zeta", b" eta", b" theta", b" omega"])
    outputs = await run(tok, request(stop=(" zeta eta theta",)), outputs_for(ids))
    assert joined(outputs) == " alpha"
    assert [o.text for o in outputs] == [" alpha", "", "", ""]
    assert outputs[-1].finish_reason == "stop"
    assert outputs[-1].stop_reason == " zeta eta theta"
    check_alignment(tok, outputs)
    # the swallowed tokens are reported: generated 4, delivered 1
    assert sum(len(o.token_ids) for o in outputs) == 4
    assert outputs[-1].delivered_tokens == 1


async def test_abandoned_prefix_is_released_in_order() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"o", b"there"])
    outputs = await run(tok, request(stop=("ozzy",)), outputs_for(ids, finish="length"))
    assert [o.text for o in outputs] == ["", "othere"]
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].delivered_tokens == 2


async def test_incomplete_match_flushed_at_max_tokens() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"say ", b"oz", b"z", b"never"])
    outputs = await run(tok, request(stop=("ozzy",), max_tokens=3), outputs_for(ids))
    assert joined(outputs) == "say ozz"
    assert outputs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outputs) == 3


# --- terminal paths ----------------------------------------------------------------------------


async def test_stream_end_without_finish_flushes_once_with_stop() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"hi o", b"z"])
    outputs = await run(tok, request(stop=("ozzy",)), outputs_for(ids))
    assert joined(outputs) == "hi oz"
    assert [o.finish_reason for o in outputs] == [None, None, "stop"]
    assert outputs[-1].token_ids == []


async def test_a_killed_request_gets_no_finish_from_an_engine_that_ended_quietly() -> None:
    # An engine that sees the kill (a deadline, a drain's abort) before the cancellation
    # reaches it ends its stream normally; that must not read as a finished answer.
    tok = ByteTokenizer()
    ctx = make_context(request())

    async def killed_midway(leg: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        yield EngineOutput(token_ids=tok.tokenize([b"hi"]))
        ctx.kill()
        if leg.is_stopped:
            return

    outputs = [o async for o in link(Backend(tok), FunctionEngine(killed_midway)).generate(ctx)]
    assert joined(outputs) == "hi"
    assert [o.finish_reason for o in outputs] == [None]


async def test_error_flushes_withheld_text_then_raises_without_finish() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"hi o", b"z"])
    backend = link(Backend(tok), ScriptedEngine(outputs_for(ids), then=EngineError("boom")))
    seen: list[BackendOutput] = []
    with pytest.raises(EngineError):
        async for o in backend.generate(make_context(request(stop=("ozzy",)))):
            seen.append(o)
    assert joined(seen) == "hi oz"
    assert all(o.finish_reason is None for o in seen)


async def test_lost_worker_keeps_withheld_text_when_a_retry_is_armed() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"o"])
    ctx = make_context(request(stop=("ozzy",)))
    ctx.state.set(RESUMABLE, True)
    backend = link(Backend(tok), ScriptedEngine(outputs_for(ids), then=StreamDisconnected("x")))
    seen: list[BackendOutput] = []
    with pytest.raises(StreamDisconnected):
        async for o in backend.generate(ctx):
            seen.append(o)
    assert joined(seen) == ""
    # The next attempt on the same request resumes: "o" + "zzy" completes the hidden stop.
    more = tok.tokenize([b"zzy", b"tail"])
    retry = link(Backend(tok), ScriptedEngine(outputs_for(more)))
    rest = await collect(retry, ctx)
    assert joined(rest) == ""
    assert rest[-1].finish_reason == "stop"
    assert rest[-1].stop_reason == "ozzy"
    assert rest[-1].delivered_tokens == 0
    # And an abandoned prefix is delivered after the failure point, in order.
    ctx2 = make_context(request(stop=("ozzy",)))
    ctx2.state.set(RESUMABLE, True)
    with pytest.raises(StreamDisconnected):
        await collect(
            link(Backend(tok), ScriptedEngine(outputs_for(ids), then=StreamDisconnected("x"))),
            ctx2,
        )
    rest = await collect(
        link(Backend(tok), ScriptedEngine(outputs_for(tok.tokenize([b"there"]), finish="length"))),
        ctx2,
    )
    assert joined(rest) == "othere"


@pytest.mark.parametrize(
    ("stop_ids", "visible", "expected", "reason"),
    [
        ((), (), "ab", None),  # EOS: hidden, no stop_reason
        ((5,), (), "ab", 5),  # user stop id: hidden, reported
    ],
)
async def test_hidden_stop_token_flushes_jail(
    stop_ids: tuple[int, ...], visible: tuple[int, ...], expected: str, reason: int | None
) -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"a", b"b"])
    stop_id = EOS if not stop_ids else stop_ids[0]
    while stop_id >= len(tok._vocab):
        tok.id_for(bytes([65 + len(tok._vocab)]))
    outputs = await run(
        tok, request(stop=("bz",), stop_token_ids=stop_ids), outputs_for([*ids, stop_id, *ids])
    )
    assert joined(outputs) == expected
    assert outputs[-1].finish_reason == "stop"
    assert outputs[-1].stop_reason == reason
    assert outputs[-1].delivered_tokens == 2
    assert sum(len(o.token_ids) for o in outputs) == 3


async def test_ignore_eos_and_min_tokens() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"a", b"b", b"c"])
    outputs = await run(
        tok, request(ignore_eos=True), outputs_for([ids[0], EOS, ids[1]], finish="length")
    )
    assert joined(outputs) == "ab"
    assert outputs[-1].finish_reason == "length"
    # min_tokens: no stop check (token or string) fires within the first min_tokens tokens.
    outputs = await run(
        tok, request(min_tokens=2, stop=("a",)), outputs_for([ids[0], EOS, ids[0], ids[2]])
    )
    assert joined(outputs) == "a"
    assert outputs[-1].stop_reason == "a"
    assert sum(len(o.token_ids) for o in outputs) == 3


async def test_earliest_stop_wins_not_list_order() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"there"])
    outputs = await run(tok, request(stop=("re", "he")), outputs_for(ids))
    assert joined(outputs) == "t"
    assert outputs[-1].stop_reason == "he"


async def test_burst_past_a_stop_is_cut_and_aligned() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"ab", b"c!", b"de"])
    burst = EngineOutput(token_ids=ids, logprobs=[-1.0, -2.0, -3.0])
    outputs = await run(tok, request(stop=("!",)), [burst])
    assert len(outputs) == 1
    assert outputs[0].token_ids == ids[:2]
    assert outputs[0].tokens == ["ab", "c!"]
    assert outputs[0].logprobs == [-1.0, -2.0]
    assert outputs[0].text == "abc"


async def test_engine_text_bypasses_the_decoder_but_not_the_jail() -> None:
    tok = ByteTokenizer()
    outs = [
        EngineOutput(token_ids=[100], text="hello o"),
        EngineOutput(token_ids=[101, 102], text="zzy and more"),
    ]
    outputs = await run(tok, request(stop=("ozzy",)), outs)
    assert joined(outputs) == "hello "
    assert outputs[-1].stop_reason == "ozzy"


async def test_multibyte_characters_arrive_whole() -> None:
    tok = ByteTokenizer()
    data = "héllo 🥳 你好".encode()
    pieces = [data[i : i + 1] for i in range(len(data))]
    outputs = await run(tok, request(), outputs_for(tok.tokenize(pieces), finish="stop"))
    assert joined(outputs) == "héllo 🥳 你好"
    assert all("\ufffd" not in o.text for o in outputs)
    check_alignment(tok, outputs)


async def test_interleaved_choices_are_isolated() -> None:
    tok = ByteTokenizer()
    a = tok.tokenize([b"o", b"zz", b"y!"])
    b = tok.tokenize([b"o", b"k"])
    outs = [
        EngineOutput(token_ids=[a[0]], index=0),
        EngineOutput(token_ids=[b[0]], index=1),
        EngineOutput(token_ids=[a[1]], index=0),
        EngineOutput(token_ids=[b[1]], index=1, finish_reason="length"),
        EngineOutput(token_ids=[a[2]], index=0),
    ]
    engine = ScriptedEngine(outs)
    outputs = await collect(link(Backend(tok), engine), make_context(request(stop=("ozzy",), n=2)))
    assert joined(outputs, 0) == ""
    assert joined(outputs, 1) == "ok"
    assert [o.finish_reason for o in outputs if o.finish_reason] == ["length", "stop"]
    # Every choice finished locally: the engine was told to stop and not polled again.
    assert engine.requests[0].is_stopped


async def test_all_choices_finished_stops_downstream_without_polling() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"a", b"b"])
    engine = ScriptedEngine(outputs_for(ids), then="hang")
    outputs = await collect(link(Backend(tok), engine), make_context(request(max_tokens=2)))
    assert joined(outputs) == "ab"
    assert engine.requests[0].is_stopped
    assert engine.open_streams == 0


async def test_backend_passes_check_operator() -> None:
    tok = ByteTokenizer()
    ids = tok.tokenize([b"a", b"b", b"c"])
    await check_operator(lambda: Backend(tok), request(), outputs_for(ids))


async def test_real_tokenizer_round_trip() -> None:
    tok = Tokenizer.default()
    text = "Hello there! Ünïcödé 🥳 and 你好, the end."
    ids = tok.encode(text)
    outputs = await collect(
        link(Backend(tok), ScriptedEngine(outputs_for(ids, finish="stop"))),
        make_context(request(stop=("the end",))),
    )
    assert joined(outputs) == "Hello there! Ünïcödé 🥳 and 你好, "
    assert all("\ufffd" not in o.text for o in outputs)
    assert outputs[-1].stop_reason == "the end"


# --- properties -----------------------------------------------------------------------------

ALPHABET = "abz é🥳你"


@dataclass
class Case:
    text: str
    cuts: list[int]
    stops: tuple[str, ...]
    include: bool
    path: str
    max_tokens: int | None


@st.composite
def cases(draw: st.DrawFn) -> Case:
    text = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=24))
    data = text.encode()
    cuts = (
        sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=len(data) - 1)))
        if len(data) > 1
        else []
    )
    stop_source = st.one_of(
        st.text(alphabet=ALPHABET, min_size=1, max_size=4),
        st.integers(0, len(text) - 1).flatmap(
            lambda i: st.integers(i + 1, min(len(text), i + 5)).map(lambda j: text[i:j])
        ),
    )
    stops = tuple(draw(st.lists(stop_source, max_size=3)))
    include = draw(st.booleans())
    path = draw(st.sampled_from(["length", "engine_stop", "eof", "error", "eos"]))
    max_tokens = draw(st.integers(1, len(cuts) + 1)) if path == "length" else None
    return Case(text, cuts, stops, include, path, max_tokens)


def expected_text(tok: ByteTokenizer, ids: list[int], case: Case) -> tuple[str, bool]:
    """The offline reference: decode everything, then cut at the earliest stop."""
    if case.max_tokens is not None:
        ids = ids[: case.max_tokens]
    full = reference_text(b"".join(tok.piece(i) for i in ids))
    found = find_stop(full, case.stops)
    if found is None:
        return full, False
    start, end, _ = found
    return (full[:end] if case.include else full[:start]), True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
async def test_any_split_any_stops_any_terminal_path(case: Case) -> None:
    tok = ByteTokenizer()
    data = case.text.encode()
    bounds = [0, *case.cuts, len(data)]
    ids = tok.tokenize([data[a:b] for a, b in itertools.pairwise(bounds)])
    script = outputs_for(ids, finish="stop" if case.path == "engine_stop" else None)
    then: BaseException | None = None
    if case.path == "eos":
        script.append(EngineOutput(token_ids=[EOS], logprobs=[-0.0]))
    if case.path == "error":
        then = EngineError("engine failed")
    req = request(
        stop=case.stops, include_stop_str_in_output=case.include, max_tokens=case.max_tokens
    )
    outputs: list[BackendOutput] = []
    raised = False
    try:
        async for o in link(Backend(tok), ScriptedEngine(script, then=then)).generate(
            make_context(req)
        ):
            outputs.append(o)
    except EngineError:
        raised = True
    want, stopped = expected_text(tok, ids, case)
    assert joined(outputs) == want
    check_alignment(tok, outputs)
    finishes = [o.finish_reason for o in outputs if o.finish_reason]
    if raised:
        assert not stopped
        assert case.path == "error"
        assert finishes == []
    else:
        assert len(finishes) == 1
        if stopped:
            assert finishes == ["stop"]
    generated = sum(len(o.token_ids) for o in outputs)
    delivered = outputs[-1].delivered_tokens if outputs else 0
    assert delivered <= generated
    if not stopped or case.include:
        # Nothing was swallowed by a hidden stop string: every text token was delivered.
        text_tokens = sum(1 for o in outputs for i in o.token_ids if i != EOS)
        assert delivered == text_tokens


@pytest.mark.parametrize("skip", [True, False])
async def test_skip_special_tokens_is_respected(skip: bool) -> None:
    tok = Tokenizer.default()
    ids = [*tok.encode("Hi"), 1, *tok.encode(" there")]  # 1 = <|im_start|>, a special token
    req = request(max_tokens=len(ids))
    req.output.skip_special_tokens = skip
    outputs = await collect(link(Backend(tok), ScriptedEngine(outputs_for(ids))), make_context(req))
    assert joined(outputs) == ("Hi there" if skip else "Hi<|im_start|> there")
    assert [t for o in outputs for t in o.tokens] == (
        ["Hi", "", " there"] if skip else ["Hi", "<|im_start|>", " there"]
    )
