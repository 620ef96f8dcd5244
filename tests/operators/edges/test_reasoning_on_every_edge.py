"""With a reasoning parser, the model's thinking reaches every edge in its own form: chat's
``reasoning_content``, a Responses ``reasoning`` item (and ``reasoning_tokens``), an
Anthropic ``thinking`` block. Each edge's reasoning settings reach the chat template the same
way (``reasoning_effort``, ``enable_thinking``), or are refused by the name the client sent.

The echo engine "says" what the test writes (a template that renders the last message, and
here and there what it was given), so the thinking is exactly ``<think>...</think>`` in the
prompt. The echo engine cannot force tokens: a setting that would need a reasoning budget is
refused on it (``tests/operators/engines/`` and ``test_thinking_budget.py`` keep budgets on
the llama and vLLM engines).
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()
SAID = "<think>It is Paris.</think>The capital is Paris."
#: a template that renders the last message only
PLAIN = "{{ messages[-1]['content'] }}"
#: a template that shows what it was given: the effort, and whether thinking is on
TELLING = (
    "{{ messages[-1]['content'] }}"
    "{% if reasoning_effort is defined %} effort={{ reasoning_effort }}{% endif %}"
    "{% if enable_thinking is defined %} thinking={{ enable_thinking }}{% endif %}"
)


def app(reasoning: str | None = "think", template: str = PLAIN) -> Any:
    return build_app(
        EchoEngine.from_tokenizer(TOKENIZER),
        TOKENIZER,
        model_name="echo",
        chat_template=template,
        reasoning_parser=reasoning,
    )


async def test_thinking_is_a_reasoning_item_on_the_responses_edge() -> None:
    async with openai_client(app()) as api:
        whole = await api.responses.create(
            model="echo", input=SAID, reasoning={"summary": "detailed"}
        )
        async with api.responses.stream(model="echo", input=SAID) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.reasoning_text.delta"]
            streamed = await stream.get_final_response()
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        reasoning = response.output[0]
        assert reasoning.type == "reasoning"
        # what the model reasoned, whole, is the item's content; no summary is made
        assert [part.text for part in reasoning.content or ()] == ["It is Paris."]
        assert reasoning.summary == []
        assert response.output_text == "The capital is Paris."
        assert response.usage is not None
        assert 0 < response.usage.output_tokens_details.reasoning_tokens
        assert response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    assert "".join(deltas) == "It is Paris."
    assert whole.reasoning is not None
    assert whole.reasoning.summary is None  # (the response says none was made)


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


async def test_chat_and_responses_give_the_template_the_same_effort() -> None:
    async with openai_client(app(template=TELLING)) as api:
        chat = await api.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "Hi."}], reasoning_effort="low"
        )
        response = await api.responses.create(
            model="echo", input="Hi.", reasoning={"effort": "low"}
        )
        off = await api.responses.create(model="echo", input="Hi.", reasoning={"effort": "none"})
    assert chat.choices[0].message.content == "Hi. effort=low thinking=True"
    assert response.output_text == "Hi. effort=low thinking=True"
    assert off.output_text == "Hi. effort=none thinking=False"
    assert response.reasoning is not None
    assert response.reasoning.effort == "low"


async def test_thinking_disabled_reaches_the_template_and_counts_the_same() -> None:
    async with anthropic_client(app(template=TELLING)) as api:
        request: Any = {"model": "echo", "messages": [{"role": "user", "content": "Hi."}]}
        message = await api.messages.create(**request, max_tokens=50, thinking={"type": "disabled"})
        counted = await api.messages.count_tokens(**request, thinking={"type": "disabled"})
    text = message.content[0].text  # type: ignore[union-attr]
    assert text == "Hi. effort=none thinking=False"
    assert counted.input_tokens == len(TOKENIZER.encode(text))


async def test_an_effort_the_template_ignores_needs_an_engine_that_ends_reasoning() -> None:
    """Where the template does not read the effort, it becomes a reasoning budget: the echo
    engine cannot keep one, and says so by the field the client sent."""
    async with openai_client(app()) as api:
        with pytest.raises(openai.BadRequestError) as on_chat:
            await api.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "Hi."}], reasoning_effort="low"
            )
        with pytest.raises(openai.BadRequestError) as on_responses:
            await api.responses.create(model="echo", input="Hi.", reasoning={"effort": "low"})
        # max: no budget at all, nothing to refuse
        most = await api.responses.create(model="echo", input=SAID, reasoning={"effort": "max"})
    chat_error: Any = on_chat.value.body
    responses_error: Any = on_responses.value.body
    assert chat_error["param"] == "reasoning_effort"
    assert "'reasoning_effort' needs an engine that can end" in chat_error["message"]
    assert responses_error["param"] == "reasoning.effort"
    assert "'reasoning.effort' needs an engine that can end" in responses_error["message"]
    assert most.output_text == "The capital is Paris."


async def test_thinking_budgets_on_the_echo_engine_are_refused_by_name() -> None:
    async with anthropic_client(app()) as api:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await api.messages.create(
                model="echo",
                max_tokens=100,
                messages=[{"role": "user", "content": "Hi."}],
                thinking={"type": "enabled", "budget_tokens": 20},
            )
    message = refused.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith("'thinking.budget_tokens' needs an engine that can end")


@pytest.mark.parametrize(
    ("reasoning", "template", "request_fields", "param"),
    [
        # no parser, a template that ignores the effort: nothing could honour it
        (None, "{{ messages[-1]['content'] }}", {"reasoning_effort": "high"}, "reasoning_effort"),
        # a parser, and a template that cannot turn reasoning off
        (
            "think",
            PLAIN,
            {"reasoning_effort": "none"},
            "reasoning_effort",
        ),
        # no parser: nothing tells reasoning from the answer, no budget can be kept
        (None, TELLING, {"extra_body": {"thinking_token_budget": 5}}, "thinking_token_budget"),
        # the budget covers the reasoning, a constraint the whole output
        (
            "think",
            PLAIN,
            {
                "extra_body": {"thinking_token_budget": 5},
                "response_format": {"type": "json_object"},
            },
            "thinking_token_budget",
        ),
    ],
)
async def test_chat_reasoning_settings_that_cannot_be_honoured_are_refused_by_name(
    reasoning: str | None, template: str, request_fields: dict[str, Any], param: str
) -> None:
    async with openai_client(app(reasoning, template)) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            await api.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "Hi."}], **request_fields
            )
    assert refused.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize(
    ("thinking", "named"),
    [
        ({"type": "disabled"}, "thinking.type"),  # a parser, a template that cannot
        ({"type": "between_tools"}, "thinking.type"),
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens"),  # >= max_tokens
        ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
        ({"type": "adaptive", "display": "omitted"}, "thinking.display"),
    ],
)
async def test_thinking_that_cannot_be_honoured_is_refused_by_name(
    thinking: dict[str, Any], named: str
) -> None:
    async with anthropic_client(app()) as api:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await api.messages.create(
                model="echo",
                max_tokens=100,
                messages=[{"role": "user", "content": "Hi."}],
                thinking=thinking,  # type: ignore[arg-type]
            )
    assert named in refused.value.body["error"]["message"]  # type: ignore[index]


async def test_adaptive_thinking_is_the_model_s_own() -> None:
    async with anthropic_client(app()) as api:
        message = await api.messages.create(
            model="echo",
            max_tokens=100,
            messages=[{"role": "user", "content": SAID}],
            thinking={"type": "adaptive"},
        )
    assert [block.type for block in message.content] == ["thinking", "text"]
