"""operators.testing.make_request: every field of a PreprocessedRequest, as a flat keyword."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from operators.contracts.llm import (
    Constraint,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    Tool,
)
from operators.testing import make_request

PARTS = {"stop": StopConditions, "sampling": SamplingOptions, "output": OutputOptions}
KEYWORDS = inspect.signature(make_request).parameters


def _fields() -> list[tuple[str | None, dataclasses.Field[object]]]:
    """(part, field) for every leaf field: the request's own (part None) and its parts'."""
    found: list[tuple[str | None, dataclasses.Field[object]]] = []
    for field in dataclasses.fields(PreprocessedRequest):
        if field.name in PARTS:
            found += [(field.name, leaf) for leaf in dataclasses.fields(PARTS[field.name])]
        else:
            found.append((None, field))
    return found


@pytest.mark.parametrize(("part", "field"), _fields(), ids=lambda f: getattr(f, "name", f))
def test_every_field_is_a_keyword_with_the_fields_default(
    part: str | None, field: dataclasses.Field[object]
) -> None:
    """A field added to the request (or a part) without a keyword here fails, by name."""
    name = field.name
    assert name in KEYWORDS, f"make_request has no keyword for {part or 'request'}.{name}"
    if field.default is not dataclasses.MISSING:  # (token_ids has none: the prompt)
        assert KEYWORDS[name].default == field.default


def test_the_defaults_are_the_requests_own() -> None:
    assert make_request() == PreprocessedRequest(token_ids=[1, 2, 3])


def test_each_keyword_lands_in_its_field() -> None:
    tool = Tool(name="f")
    constraint = Constraint(param="response_format")
    request = make_request(
        iter([4, 5]),
        max_tokens=8,
        min_tokens=2,
        stop=["x"],
        stop_token_ids=[9],
        eos_token_ids={7},
        include_stop_str_in_output=True,
        ignore_eos=True,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.1,
        seed=3,
        presence_penalty=0.2,
        frequency_penalty=-0.2,
        repetition_penalty=1.1,
        logprobs=2,
        skip_special_tokens=False,
        n=2,
        replayed_tokens=1,
        model="m",
        tools=[tool],
        constraint=constraint,
        priority=-1,
        lora="tiny",
    )
    assert request == PreprocessedRequest(
        token_ids=[4, 5],
        stop=StopConditions(
            max_tokens=8,
            min_tokens=2,
            stop=("x",),
            stop_token_ids=(9,),
            eos_token_ids=(7,),
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
        sampling=SamplingOptions(
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.1,
            seed=3,
            presence_penalty=0.2,
            frequency_penalty=-0.2,
            repetition_penalty=1.1,
        ),
        output=OutputOptions(logprobs=2, skip_special_tokens=False),
        n=2,
        replayed_tokens=1,
        model="m",
        tools=(tool,),
        constraint=constraint,
        priority=-1,
        lora="tiny",
    )
    assert request.prompt_tokens == 1
