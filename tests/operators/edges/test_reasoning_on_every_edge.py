"""With a reasoning parser, the model's thinking reaches every edge in its own form: chat's
``reasoning_content``, a Responses ``reasoning`` item (and ``reasoning_tokens``), an
Anthropic ``thinking`` block; without one, ``reasoning`` on the Responses API is refused.

The echo engine "says" what the test writes (a template that renders only the last
message), so the thinking is exactly ``<think>...</think>`` in the prompt.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()
SAID = "<think>It is Paris.</think>The capital is Paris."


def app(reasoning: str | None = "think") -> Any:
    return build_app(
        EchoEngine.from_tokenizer(TOKENIZER),
        TOKENIZER,
        model_name="echo",
        chat_template="{{ messages[-1]['content'] }}",
        reasoning_parser=reasoning,
    )


async def test_thinking_is_a_reasoning_item_on_the_responses_edge() -> None:
    async with openai_client(app()) as api:
        whole = await api.responses.create(model="echo", input=SAID, reasoning={"effort": "low"})
        async with api.responses.stream(model="echo", input=SAID) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.reasoning_text.delta"]
            streamed = await stream.get_final_response()
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        reasoning = response.output[0]
        assert reasoning.type == "reasoning"
        assert [part.text for part in reasoning.content or ()] == ["It is Paris."]
        assert response.output_text == "The capital is Paris."
        assert response.usage is not None
        assert 0 < response.usage.output_tokens_details.reasoning_tokens
        assert response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    assert "".join(deltas) == "It is Paris."
    assert whole.reasoning is not None
    assert whole.reasoning.effort == "low"


async def test_thinking_is_a_thinking_block_on_the_messages_edge() -> None:
    async with anthropic_client(app()) as api:
        request: Any = {
            "model": "echo",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": SAID}],
        }
        whole = await api.messages.create(**request)
        async with api.messages.stream(**request) as stream:
            streamed = await stream.get_final_message()
    for message in (whole, streamed):
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "It is Paris."  # type: ignore[union-attr]
        assert message.content[1].text == "The capital is Paris."  # type: ignore[union-attr]


async def test_reasoning_without_a_parser_is_refused_by_name() -> None:
    async with openai_client(app(None)) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            await api.responses.create(model="echo", input="hi", reasoning={"effort": "high"})
    assert refused.value.body["param"] == "reasoning"  # type: ignore[index]
