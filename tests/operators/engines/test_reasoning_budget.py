"""The reasoning clock the llama and vLLM engines share, as properties: whatever a model
writes, a choice reasons at most its budget plus the end marker per reasoning block; nothing
is forced outside the reasoning or within the budget; a forced marker completes the one the
model had begun; and a clock fed a migrated request's replayed output goes on exactly as the
first attempt's would have. The budget crosses NATS as every request field does.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.contracts.constraint_guard import GUARDED, guarded
from operators.contracts.llm import (
    CONSTRAINED_DECODING,
    REASONING_BUDGET,
    Constraint,
    EngineOutput,
    PreprocessedRequest,
    ReasoningBudget,
)
from operators.contracts.transport import llm_codec
from operators.engines._reasoning_budget import ReasoningClock, check_budget
from pipeline import Context, InvalidRequest
from pipeline.testing import collect, make_context

START = (1, 2)
END = (3, 4, 5)


def budget(tokens: int, *, open_: bool) -> ReasoningBudget:
    return ReasoningBudget(
        param="thinking_token_budget", tokens=tokens, end=END, start=START, open=open_
    )


def run(clock: ReasoningClock, wanted: list[int]) -> tuple[list[int], list[bool]]:
    """The tokens a choice takes when the model wants ``wanted`` (one per step), and which
    of them were forced."""
    taken: list[int] = []
    forced: list[bool] = []
    for token in wanted:
        force = clock.forced
        taken.append(token if force is None else force)
        forced.append(force is not None)
        clock.advance(taken[-1])
    return taken, forced


def blocks(tokens: list[int], *, open_: bool) -> list[tuple[int, int]]:
    """Where the reasoning blocks of ``tokens`` are, found on the whole sequence: (first
    token inside, one past its end marker), the last one possibly unclosed."""
    found: list[tuple[int, int]] = []
    inside, begin, position = open_, 0, 0
    while position < len(tokens):
        marker = END if inside else START
        if tuple(tokens[position : position + len(marker)]) == marker:
            position += len(marker)
            if inside:
                found.append((begin, position))
            begin = position
            inside = not inside
        else:
            position += 1
    if inside:
        found.append((begin, len(tokens)))
    return found


wanted_tokens = st.lists(st.integers(0, 6), max_size=80)


@settings(max_examples=400, deadline=None)
@given(wanted=wanted_tokens, limit=st.integers(0, 20), open_=st.booleans())
def test_a_choice_reasons_at_most_its_budget_plus_the_marker(
    wanted: list[int], limit: int, open_: bool
) -> None:
    taken, forced = run(ReasoningClock(budget(limit, open_=open_)), wanted)
    spans = blocks(taken, open_=open_)
    spent = 0
    for begin, end in spans:
        inside = end - begin
        # the budget is for all blocks together: a block past it is closed at once
        assert inside <= max(limit - spent, 0) + len(END)
        spent += inside
    inside_at = {i for begin, end in spans for i in range(begin, end)}
    for position, was_forced in enumerate(forced):
        if was_forced:
            assert position in inside_at  # never outside the reasoning
            assert sum(1 for i in inside_at if i < position) >= limit  # never within budget


@settings(max_examples=200, deadline=None)
@given(head=st.lists(st.integers(6, 9), max_size=10), limit=st.integers(0, 20))
def test_a_model_that_ends_within_its_budget_is_left_alone(head: list[int], limit: int) -> None:
    head = head[: max(limit - len(END), 0)]
    wanted = [*head, *END, 7, 8]  # its own end marker, as the budget allows
    taken, forced = run(ReasoningClock(budget(limit, open_=True)), wanted)
    assert taken == wanted  # (what is forced, if the marker runs past, is what it wrote)
    if len(head) + len(END) <= limit:
        assert not any(forced)


@given(limit=st.integers(1, 10), begun=st.integers(1, len(END) - 1))
def test_a_forced_marker_completes_the_one_begun(limit: int, begun: int) -> None:
    # the model writes filler, then begins the end marker exactly as the budget runs out
    begun = min(begun, limit)
    wanted = [7] * (limit - begun) + list(END[:begun]) + [8] * 10
    taken, _ = run(ReasoningClock(budget(limit, open_=True)), wanted)
    assert taken[: limit + len(END) - begun] == [7] * (limit - begun) + list(END)
    assert taken.count(END[0]) == 1  # never "</</think>"


@settings(max_examples=200, deadline=None)
@given(wanted=wanted_tokens, limit=st.integers(0, 20), open_=st.booleans(), cut=st.integers(0, 80))
def test_a_retry_continues_the_count_of_the_first_attempt(
    wanted: list[int], limit: int, open_: bool, cut: int
) -> None:
    whole, _ = run(ReasoningClock(budget(limit, open_=open_)), wanted)
    first, _ = run(ReasoningClock(budget(limit, open_=open_)), wanted[:cut])
    retried, _ = run(ReasoningClock(budget(limit, open_=open_), first), wanted[cut:])
    assert first + retried == whole


def test_the_budget_crosses_nats_as_every_field() -> None:
    codec = llm_codec()
    request = PreprocessedRequest(token_ids=[1, 2], reasoning_budget=budget(8, open_=True))
    back = codec.decode(codec.encode(request))
    assert back == request
    assert isinstance(back.reasoning_budget, ReasoningBudget)
    assert back.reasoning_budget.end == END


def test_a_budget_no_engine_can_keep_is_refused_by_name() -> None:
    markerless = ReasoningBudget(param="reasoning_effort", tokens=5, end=())
    for request in (
        PreprocessedRequest(token_ids=[1], reasoning_budget=markerless),
        PreprocessedRequest(
            token_ids=[1],
            reasoning_budget=budget(5, open_=True),
            constraint=Constraint(param="response_format"),
        ),
    ):
        assert request.reasoning_budget is not None
        with pytest.raises(InvalidRequest) as refused:
            check_budget(request, "r")
        assert refused.value.param == request.reasoning_budget.param


class Forcing:
    """An engine that declares what it honours, and answers one token."""

    def __init__(self, features: frozenset[str]) -> None:
        self.features = features

    async def generate(self, ctx: Context[PreprocessedRequest]):  # type: ignore[no-untyped-def]
        yield EngineOutput([9], finish_reason="stop")


async def test_the_guard_refuses_a_budget_only_where_the_engine_cannot_keep_it() -> None:
    request = PreprocessedRequest(token_ids=[1], reasoning_budget=budget(4, open_=True))
    able = Forcing(GUARDED)
    assert guarded(able) is able  # nothing in front of an engine that keeps both
    outputs = await collect(guarded(able), make_context(request))
    assert [output.token_ids for output in outputs] == [[9]]
    unable = guarded(Forcing(frozenset({CONSTRAINED_DECODING})))
    with pytest.raises(InvalidRequest) as refused:
        await collect(unable, make_context(request))
    assert refused.value.param == "thinking_token_budget"
    assert "'thinking_token_budget' needs an engine that can end" in refused.value.message
    assert REASONING_BUDGET in GUARDED
