"""The OutputParsers operator over the Backend: text parsed, tokens and logprobs aligned.

Engine outputs are byte tokens (``byte_tokenizer``) cut at random byte positions, inside
markers and multi-byte characters; the Backend decodes them as in the default graph.
Above it the operator must give the parse of the whole text, report every token once, and
deliver a token exactly when the parsers have decided the text it starts with.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from operators.backend import Backend
from operators.contracts.llm import (
    BackendOutput,
    EngineOutput,
    PreprocessedRequest,
)
from operators.edges.openai.logprobs import ChoiceState
from operators.parsers import (
    HERMES,
    THINK,
    MarkerToolFormat,
    OutputParsers,
    ReasoningFormat,
    ToolCallFormat,
    register_tool_parser,
    tool_parser,
)
from operators.testing import make_request
from pipeline import Context, Stream, link
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context
from tests.helpers.byte_tokenizer import ByteTokenizer
from tests.operators.parsers.parser_cases import TOOLS, Case, decided, hermes_cases

EOS = ByteTokenizer.EOS
TEST_TIME_LIMIT = 10.0  # (as tests/conftest.py gives every async test)


def call_id(choice: int, call: int) -> str:
    return f"call_{choice}_{call}"


#: every request here: offers TOOLS, asks for logprobs, EOS as the tokenizer's end
request = functools.partial(
    make_request, token_ids=[7, 8, 9], eos_token_ids=(EOS,), logprobs=0, tools=TOOLS
)


def engine_outputs(
    tok: ByteTokenizer, pieces: Sequence[bytes], *, index: int = 0, finish: Any = "stop"
) -> list[EngineOutput]:
    ids = tok.tokenize(pieces)
    outputs = [EngineOutput([i], [-float(i)], index=index) for i in ids]
    if outputs:
        outputs[-1].finish_reason = finish
    return outputs


def byte_pieces(text: str, cuts: Sequence[int]) -> list[bytes]:
    data = text.encode()
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def run(graph: Any, req: PreprocessedRequest) -> list[BackendOutput]:
    """``collect`` from a synchronous (Hypothesis) test, under the suite's time limit."""

    async def limited() -> list[BackendOutput]:
        with anyio.fail_after(TEST_TIME_LIMIT):
            return await collect(graph, make_context(req))

    return anyio.run(limited)


def assembled(outputs: Sequence[BackendOutput], index: int = 0) -> dict[str, Any]:
    """One choice's answer as a client assembles the stream."""
    calls: dict[int, list[str]] = {}
    finishes = []
    for output in outputs:
        if output.index != index:
            continue
        for delta in output.tool_calls or ():
            if delta.id is not None:
                calls[delta.index] = [delta.id, delta.name or "", ""]
            calls[delta.index][2] += delta.arguments
        if output.finish_reason is not None:
            finishes.append(output.finish_reason)
    mine = [output for output in outputs if output.index == index]
    return {
        "content": "".join(output.text for output in mine),
        "reasoning": "".join(output.reasoning for output in mine),
        "calls": [(name, args) for _, name, args in (calls[i] for i in sorted(calls))],
        "ids": [calls[i][0] for i in sorted(calls)],
        "finish": finishes,
    }


def graph(
    tok: ByteTokenizer,
    outputs: Sequence[EngineOutput],
    tools: ToolCallFormat | None = HERMES,
    reasoning: ReasoningFormat | None = THINK,
) -> Any:
    parsers = OutputParsers(tools, reasoning, call_ids=call_id)
    return link(parsers, Backend(tok), ScriptedEngine(outputs))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_byte_split_through_the_backend(data: st.DataObject) -> None:
    """Content, reasoning and calls are the whole text's; every token is delivered once,
    in order, exactly when the text it starts with is decided (never while withheld)."""
    case: Case = data.draw(hermes_cases(think=True))
    assume(case.text)
    size = len(case.text.encode())
    cuts = data.draw(st.lists(st.integers(1, max(1, size - 1)), max_size=size))
    tok = ByteTokenizer()
    outs = engine_outputs(tok, byte_pieces(case.text, cuts))
    req = request()
    backend = run(link(Backend(tok), ScriptedEngine(outs)), req)
    parsed = run(graph(tok, outs), req)
    answer = assembled(parsed)
    expected_finish = "tool_calls" if case.calls else "stop"
    assert (answer["content"], answer["reasoning"]) == (case.content, case.reasoning)
    assert answer["calls"] == case.calls
    assert answer["finish"] == [expected_finish]
    assert len(parsed) == len(backend), "one output per Backend output"

    fed = 0
    starts = [0]  # start offset of each token, and the end of the text
    state = ChoiceState(0)
    shown: list[Any] = []
    for mine, theirs in zip(parsed, backend, strict=True):
        assert (mine.token_ids, mine.tokens, mine.logprobs) == (
            theirs.token_ids,
            theirs.tokens,
            theirs.logprobs,
        )
        for token in theirs.tokens:
            starts.append(starts[-1] + len(token))
        fed += len(theirs.text)
        consumed = decided(case, fed, think=True, tools=True)
        if theirs.finish_reason is not None:
            consumed = fed  # the parsers finished: nothing is withheld any more
        expected = theirs.delivered_tokens
        if consumed < fed:
            expected = min(expected, sum(1 for s in starts[:-1] if s < consumed))
        assert mine.delivered_tokens == expected, (case.text[:fed], consumed)
        shown.extend(state.delivered(mine))
    assert "".join(entry[1] for entry in shown) == case.text
    assert [entry[0] for entry in shown] == [i for out in outs for i in out.token_ids]


async def sample_outputs(tok: ByteTokenizer, *, n: int = 1) -> list[BackendOutput]:
    text = 'Hm <think>plan ☀️</think>Sure <tool_call>{"name": "f", "arguments": {"a": 1}}'
    text += '</tool_call> and <tool_call>{"name": "nope"}</tool_call>.'
    pieces = byte_pieces(text, range(0, len(text.encode()), 3))
    outs = [engine_outputs(tok, pieces, index=i) for i in range(n)]
    interleaved = [out for step in zip(*outs, strict=True) for out in step]
    return await collect(
        link(Backend(tok), ScriptedEngine(interleaved)), make_context(request(n=n))
    )


async def test_the_operator_contract_with_a_retry_at_every_output() -> None:
    tok = ByteTokenizer()
    outputs = await sample_outputs(tok, n=2)

    def factory() -> OutputParsers:
        return OutputParsers(HERMES, THINK, call_ids=call_id)

    await check_operator(factory, request(n=2), outputs, retry=True)


async def test_choices_are_parsed_apart() -> None:
    tok = ByteTokenizer()
    outputs = await sample_outputs(tok, n=2)
    parsed = await collect(link(OutputParsers(HERMES, THINK), ScriptedEngine(outputs)),
                           make_context(request(n=2)))  # fmt: skip
    first, second = assembled(parsed, 0), assembled(parsed, 1)
    assert first["calls"] == second["calls"] == [("f", '{"a": 1}')]
    assert first["content"] == second["content"]
    assert first["content"] == 'Hm Sure  and <tool_call>{"name": "nope"}</tool_call>.'
    assert first["reasoning"] == "plan ☀️"
    assert first["finish"] == second["finish"] == ["tool_calls"]
    assert first["ids"] != second["ids"], "random ids unless call_ids says otherwise"


def scripted(pieces: Sequence[str], finish: Any = "stop") -> list[BackendOutput]:
    """Backend outputs with one token per piece (ids 100, 101, ...), all delivered."""
    return [
        BackendOutput([100 + i], [piece], piece, [-1.0], None,
                      finish if i == len(pieces) - 1 else None, None, 0, i + 1)
        for i, piece in enumerate(pieces)
    ]  # fmt: skip


async def test_a_token_is_delivered_once_its_first_character_is_decided() -> None:
    pieces = ["Hi", " <tool", "_call>", '{"name": "f"}', "</tool_call>", " ok"]
    outputs = await collect(
        link(OutputParsers(HERMES), ScriptedEngine(scripted(pieces))), make_context(request())
    )
    assert [out.delivered_tokens for out in outputs] == [1, 2, 2, 2, 5, 6]
    assert [out.text for out in outputs] == ["Hi", " ", "", "", "", " ok"]
    assert [bool(out.tool_calls) for out in outputs] == [False] * 4 + [True, False]
    assert outputs[-1].finish_reason == "tool_calls"


async def test_finish_reasons() -> None:
    call = ['<tool_call>{"name": "f"}</tool_call>']
    for pieces, finish, expected in [
        (call, "stop", "tool_calls"),
        (call, "length", "length"),  # cut off after a call: still "length"
        (["plain"], "stop", "stop"),
        (['<tool_call>{"name": "x"}</tool_call>'], "stop", "stop"),  # not a call: content
    ]:
        outputs = await collect(
            link(OutputParsers(HERMES), ScriptedEngine(scripted(pieces, finish))),
            make_context(request()),
        )
        assert outputs[-1].finish_reason == expected, pieces


async def test_a_stream_without_a_finish_still_releases_what_is_withheld() -> None:
    outputs = scripted(["a <think>b", " </thi"], finish=None)
    parsed = await collect(
        link(OutputParsers(HERMES, THINK), ScriptedEngine(outputs)), make_context(request())
    )
    assert len(parsed) == 3
    assert (parsed[-1].token_ids, parsed[-1].finish_reason) == ([], None)
    assert assembled(parsed)["reasoning"] == "b </thi"
    assert parsed[-1].delivered_tokens == 2


async def test_hidden_stops_and_eos_leave_their_tokens_undelivered() -> None:
    tok = ByteTokenizer()
    text = 'a <tool_call>{"name": "f"}</tool_call> bSTOP more'
    outs = engine_outputs(tok, byte_pieces(text, range(0, 60, 2)))
    parsed = await collect(graph(tok, outs), make_context(request(stop=("STOP",))))
    answer = assembled(parsed)
    assert (answer["content"], answer["finish"]) == ("a  b", ["tool_calls"])
    backend = await collect(link(Backend(tok), ScriptedEngine(outs)),
                            make_context(request(stop=("STOP",))))  # fmt: skip
    assert parsed[-1].delivered_tokens == backend[-1].delivered_tokens
    generated = sum(len(out.token_ids) for out in parsed)
    assert parsed[-1].delivered_tokens < generated  # the stop string's tokens

    outs = engine_outputs(tok, [b"x<tool_call>", b'{"name": "f"}'], finish=None)
    outs.append(EngineOutput([EOS], [-1.0]))  # EOS ends the open call: parsed at the end
    parsed = await collect(graph(tok, outs), make_context(request()))
    assert assembled(parsed)["calls"] == [("f", "{}")]
    assert parsed[-1].finish_reason == "tool_calls"
    assert parsed[-1].delivered_tokens == 2  # EOS is hidden


async def test_reasoning_without_tools_and_tools_without_reasoning() -> None:
    outputs = scripted(["<think>x</think>y ", '<tool_call>{"name": "f"}</tool_call>'])
    no_tools = await collect(
        link(OutputParsers(HERMES, THINK), ScriptedEngine(outputs)),
        make_context(request(tools=())),
    )
    answer = assembled(no_tools)
    assert (answer["reasoning"], answer["calls"]) == ("x", [])
    assert answer["content"] == 'y <tool_call>{"name": "f"}</tool_call>'
    no_reasoning = await collect(
        link(OutputParsers(HERMES), ScriptedEngine(outputs)), make_context(request())
    )
    answer = assembled(no_reasoning)
    assert (answer["reasoning"], answer["content"]) == ("", "<think>x</think>y ")
    assert answer["calls"] == [("f", "{}")]


class _FixedStream:
    """An engine whose every stream is one recorded object."""

    def __init__(self) -> None:
        self.stream = ScriptedEngine(["out"]).generate(make_context(None))

    def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        return self.stream


@pytest.mark.parametrize(
    ("parsers", "tools"),
    [
        (OutputParsers(HERMES), ()),
        (OutputParsers(), TOOLS),
        (OutputParsers(None, None), ()),
    ],
)
async def test_nothing_to_parse_costs_no_hop(parsers: OutputParsers, tools: Any) -> None:
    engine = _FixedStream()
    stream = link(parsers, engine).generate(make_context(request(tools=tools)))
    assert stream is engine.stream
    await engine.stream.aclose()


async def test_a_format_registered_from_python_parses_through_the_operator() -> None:
    register_tool_parser("angles", MarkerToolFormat(start="<<", end=">>", name="angles"))  # (stays)
    tok = ByteTokenizer()
    pieces = [b"Sure <", b'<{"name": "get_weather", "arguments": {"city": "', b'Paris"}}>', b">"]
    outs = engine_outputs(tok, pieces)
    parsed = await collect(graph(tok, outs, tool_parser("angles"), None), make_context(request()))
    answer = assembled(parsed)
    assert (answer["content"], answer["calls"]) == (
        "Sure ",
        [("get_weather", '{"city": "Paris"}')],
    )
    assert answer["ids"] == ["call_0_0"]
    assert repr(OutputParsers(tool_parser("angles"), THINK)) == (
        "OutputParsers(tools='angles', reasoning='think')"
    )
