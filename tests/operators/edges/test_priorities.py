"""A request's ``priority``: on every generation endpoint, bounded, defaulted by its API key,
carried to the engine (``PreprocessedRequest.priority``) and across NATS's codec."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from operators.cli.config import key_priorities
from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.contracts.transport import llm_codec
from operators.edges.http.guard import Guard
from operators.edges.http.schema import MAX_INT
from operators.serving import build_app
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline.testing import ScriptedEngine

TOKENIZER = Tokenizer.default()
HI: Any = [{"role": "user", "content": "hi"}]


def outputs() -> list[EngineOutput]:
    return [EngineOutput([TOKENIZER.encode("ok")[0]], finish_reason="stop")]


def recording(**guard: Any) -> tuple[Any, ScriptedEngine[EngineOutput]]:
    engine: ScriptedEngine[EngineOutput] = ScriptedEngine(outputs())
    return build_app(engine, TOKENIZER, model_name="m", guard=Guard(**guard)), engine


def priorities(engine: ScriptedEngine[EngineOutput]) -> list[int]:
    return [ctx.data.priority for ctx in engine.requests]


async def test_every_generation_endpoint_carries_the_priority_to_the_engine() -> None:
    app, engine = recording()
    async with openai_client(app) as api:
        await api.chat.completions.create(model="m", messages=HI, extra_body={"priority": -3})
        await api.completions.create(model="m", prompt="x", extra_body={"priority": 7})
        await api.responses.create(model="m", input="x", extra_body={"priority": 2})
        await api.chat.completions.create(model="m", messages=HI)
    async with anthropic_client(app) as claude:
        await claude.messages.create(
            model="m", max_tokens=5, messages=HI, extra_body={"priority": MAX_INT}
        )
    assert priorities(engine) == [-3, 7, 2, 0, MAX_INT]


async def test_an_api_keys_priority_is_the_default_and_a_requests_own_wins() -> None:
    app, engine = recording(api_keys={"batch": 10, "interactive": -5, "plain": 0})
    async with openai_client(app, api_key="batch") as api:
        await api.chat.completions.create(model="m", messages=HI)
        await api.chat.completions.create(model="m", messages=HI, extra_body={"priority": 1})
    async with openai_client(app, api_key="interactive") as api:
        await api.chat.completions.create(model="m", messages=HI)
    async with anthropic_client(app, api_key="plain") as claude:
        await claude.messages.create(model="m", max_tokens=5, messages=HI)
    assert priorities(engine) == [10, 1, -5, 0]


@pytest.mark.parametrize("value", [MAX_INT + 1, -MAX_INT - 1, 1.5, "high", True, [1]])
async def test_a_priority_out_of_bounds_or_not_an_integer_is_a_400_naming_it(value: Any) -> None:
    app, engine = recording()
    async with openai_client(app) as api:
        for call in (
            api.chat.completions.create(model="m", messages=HI, extra_body={"priority": value}),
            api.completions.create(model="m", prompt="x", extra_body={"priority": value}),
            api.responses.create(model="m", input="x", extra_body={"priority": value}),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await call
            assert refused.value.body["param"] == "priority"  # type: ignore[index]
    async with anthropic_client(app) as claude:
        with pytest.raises(anthropic.BadRequestError) as refused_messages:
            await claude.messages.create(
                model="m", max_tokens=5, messages=HI, extra_body={"priority": value}
            )
    assert "priority" in str(refused_messages.value)
    assert engine.requests == []


def test_the_priority_crosses_the_nats_codec() -> None:
    codec = llm_codec()
    request = PreprocessedRequest(token_ids=[1, 2], priority=-7, lora="tiny")
    decoded = codec.decode(codec.encode(request))
    assert decoded == request
    assert codec.decode(codec.encode(PreprocessedRequest(token_ids=[1]))).priority == 0


def test_api_keys_with_priorities_are_parsed_from_the_command_line() -> None:
    assert key_priorities(["a", "b:5", "c:-2", "d:+3", "e:f:1", "g:x"]) == {
        "a": 0,
        "b": 5,
        "c": -2,
        "d": 3,
        "e:f": 1,
        "g:x": 0,
    }
    with pytest.raises(ValueError, match="priority"):
        key_priorities([f"a:{2**40}"])
    with pytest.raises(ValueError, match="empty"):
        key_priorities([":3"])
