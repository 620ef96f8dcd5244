"""``coalesce_outputs``: the token outputs a worker sent together, merged into bursts.

The frontend's graph must not be able to tell: for any outputs, any way the worker grouped
them into batches and any stop conditions, the Backend over the merged outputs gives the
client the same text, token ids, logprobs of the delivered tokens, finish and stop reason
and usage as over the outputs one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators.backend import Backend
from operators.contracts.llm import BackendOutput, EngineOutput, PreprocessedRequest, StopConditions
from operators.contracts.transport import coalesce_outputs
from pipeline import link
from pipeline.testing import ScriptedEngine, collect, make_context
from tests.helpers.byte_tokenizer import ByteTokenizer

EOS = ByteTokenizer.EOS
TOKENIZER = ByteTokenizer()


@dataclass
class Case:
    outputs: list[EngineOutput]
    batches: list[int]  # how many outputs each batch holds, in order
    stop: StopConditions


@st.composite
def token_ids(draw: st.DrawFn) -> list[int]:
    """One choice's tokens: a byte per token ("é" split in two), EOS between characters."""
    ids: list[int] = []
    for char in draw(st.text(alphabet="ab é", min_size=1, max_size=10)):
        ids += TOKENIZER.tokenize([bytes([byte]) for byte in char.encode()])
        if draw(st.integers(0, 7)) == 0:
            ids.append(EOS)
    return ids


@st.composite
def cases(draw: st.DrawFn) -> Case:
    logprobs = draw(st.booleans())
    top = draw(st.booleans())
    left = [draw(token_ids()) for _ in range(draw(st.integers(1, 2)))]
    outputs = []
    while any(left):
        index = draw(st.sampled_from([i for i, ids in enumerate(left) if ids]))
        size = draw(st.integers(1, 3))
        ids, left[index] = left[index][:size], left[index][size:]
        output = EngineOutput(ids, index=index)
        if logprobs:
            output.logprobs = [-float(i) for i in ids]
        if top:
            output.top_logprobs = [[(i, -1.0)] for i in ids]
        if not left[index] and draw(st.booleans()):
            output.finish_reason = "stop"
        if draw(st.integers(0, 9)) == 0:
            output.cached_tokens = 3
        outputs.append(output)
    sizes: list[int] = []
    while sum(sizes) < len(outputs):
        sizes.append(draw(st.integers(1, len(outputs) - sum(sizes))))
    stop_ids = TOKENIZER.tokenize([b"a", b"b", b" "])
    stop = StopConditions(
        stop=tuple(draw(st.lists(st.sampled_from(["a", "b", "é", "ab", " é", "ba"]), max_size=2))),
        max_tokens=draw(st.none() | st.integers(1, 20)),
        min_tokens=draw(st.integers(0, 3)),
        include_stop_str_in_output=draw(st.booleans()),
        stop_token_ids=tuple(draw(st.lists(st.sampled_from(stop_ids), max_size=1))),
        eos_token_ids=(EOS,),
        ignore_eos=draw(st.booleans()),
    )
    return Case(outputs, sizes, stop)


def copies(outputs: list[EngineOutput]) -> list[EngineOutput]:
    return [
        EngineOutput(
            list(o.token_ids),
            None if o.logprobs is None else list(o.logprobs),
            None if o.top_logprobs is None else list(o.top_logprobs),
            o.finish_reason,
            o.index,
            o.text,
            None,
            None,
            o.cached_tokens,
        )
        for o in outputs
    ]


def seen_by_a_client(outputs: list[BackendOutput], n: int) -> dict[int, tuple[object, ...]]:
    """Per choice: its text, ids, the logprobs of its delivered tokens, finish, stop reason."""
    seen = {}
    for index in range(n):
        mine = [o for o in outputs if o.index == index]
        ids = [i for o in mine for i in o.token_ids]
        logprobs = [p for o in mine for p in o.logprobs or []]
        top = [t for o in mine for t in o.top_logprobs or []]
        delivered = mine[-1].delivered_tokens if mine else 0
        seen[index] = (
            "".join(o.text for o in mine),
            ids,
            logprobs[:delivered],
            top[:delivered],
            delivered,
            [(o.finish_reason, o.stop_reason) for o in mine if o.finish_reason],
        )
    return seen


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
async def test_the_graph_cannot_tell_merged_outputs_from_the_outputs_one_by_one(
    case: Case,
) -> None:
    n = 1 + max(o.index for o in case.outputs)
    request = PreprocessedRequest(token_ids=[7, 8, 9], n=n, stop=case.stop)
    tok = TOKENIZER
    one_by_one = await collect(
        link(Backend(tok), ScriptedEngine(copies(case.outputs))), make_context(request)
    )
    given = copies(case.outputs)
    merged: list[EngineOutput] = []
    start = 0
    for size in case.batches:
        batch = given[start : start + size]
        before = copies(batch)
        merged += coalesce_outputs(batch)
        assert copies(batch) == before  # the outputs given are not modified
        start += size
    assert sum(len(o.token_ids) for o in merged) == sum(len(o.token_ids) for o in case.outputs)
    bursts = await collect(link(Backend(tok), ScriptedEngine(merged)), make_context(request))
    assert seen_by_a_client(bursts, n) == seen_by_a_client(one_by_one, n)


def test_runs_of_one_choice_merge_and_what_must_stay_apart_does() -> None:
    def out(*ids: int, **fields: object) -> EngineOutput:
        return EngineOutput(list(ids), **fields)  # type: ignore[arg-type]

    assert coalesce_outputs([out(1), out(2), out(3, finish_reason="length")]) == [
        out(1, 2, 3, finish_reason="length")
    ]
    assert coalesce_outputs([out(1, logprobs=[-1.0]), out(2, logprobs=[-2.0])]) == [
        out(1, 2, logprobs=[-1.0, -2.0])
    ]
    apart = [
        [out(1, index=0), out(2, index=1), out(3, index=0)],  # choices keep their interleaving
        [out(1, finish_reason="stop"), out(2)],  # nothing joins a finished output
        [out(1, text="x"), out(2)],  # self-decoded text belongs to its own first token
        [out(1), out(2, text="y")],
        [out(1), out(2, cached_tokens=4)],  # an attempt's first output
        [out(1, prefill_result={"h": 1}), out(2)],
        [out(1), out(2, encoder_result={"e": 1})],
        [out(1, logprobs=[-1.0]), out(2)],  # logprobs stay aligned with the ids
        [out(1, top_logprobs=[[(1, -1.0)]]), out(2)],
    ]
    for outputs in apart:
        assert coalesce_outputs(outputs) == outputs
    assert coalesce_outputs([out(1)]) == [out(1)]
    assert coalesce_outputs([]) == []
