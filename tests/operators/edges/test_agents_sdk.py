"""The OpenAI Agents SDK (``openai-agents``) against a real ``llm-pipeline serve``, over the
Responses API and chat completions, with the settings it is used with: ``truncation="auto"``
and ``Reasoning(effort="low", summary="auto")``.

The echo engine answers with its prompt, so the answer shows what the model was given:
the template below opens with the reasoning effort it got, inside ``<think>`` markers (so the
``think`` reasoning parser makes it the answer's reasoning), then every message as
``[role]content``. Truncation is seen in which messages are left; its exactness is checked
against the same requests sent without it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
)
from agents.items import MessageOutputItem, ReasoningItem
from openai.types.shared import Reasoning

from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% if reasoning_effort is defined %}<think>effort {{ reasoning_effort }}</think>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
)
#: the context: the long conversation below does not fit it
CONTEXT = 256
#: the answer's room (``max_output_tokens``): a prompt fits when it leaves this much, and the
#: echo engine has the room to say all of a prompt that fits
ROOM = 128
INSTRUCTIONS = "Be brief."
#: twelve turns of about 25 tokens each: about 300 tokens in all
TURNS: list[dict[str, Any]] = [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "word " * 22}
    for i in range(12)
]
SETTINGS = ModelSettings(
    truncation="auto", reasoning=Reasoning(effort="low", summary="auto"), max_tokens=ROOM
)
NO_TRACES = RunConfig(tracing_disabled=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "effort.jinja"
    template.write_text(TEMPLATE)
    process = ServerProcess(
        "--chat-template",
        str(template),
        "--reasoning-parser",
        "think",
        "--max-model-len",
        str(CONTEXT),
    )
    yield process
    process.stop()


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="x", max_retries=0, timeout=30
    ) as api:
        yield api


def agent(model: Any) -> Agent[Any]:
    return Agent(name="echo", instructions=INSTRUCTIONS, model=model, model_settings=SETTINGS)


def reasoning_text(item: ReasoningItem) -> str:
    """What a reasoning item says: its content (Responses) or its summary (the SDK puts
    chat's ``reasoning_content`` there)."""
    raw = item.raw_item
    parts = [*(raw.content or ()), *raw.summary]
    return "".join(part.text for part in parts)


async def test_the_agents_sdk_over_responses_sends_effort_and_truncation(
    client: openai.AsyncOpenAI,
) -> None:
    result = await Runner.run(
        agent(OpenAIResponsesModel("echo", client)), "Hello there.", run_config=NO_TRACES
    )
    [reasoning] = [item for item in result.new_items if isinstance(item, ReasoningItem)]
    assert reasoning_text(reasoning) == "effort low"
    assert reasoning.raw_item.summary == []  # (no summary is made: the content is it all)
    assert result.final_output == f"[system]{INSTRUCTIONS}[user]Hello there."
    [response] = result.raw_responses
    assert response.usage.input_tokens < CONTEXT - ROOM


async def test_a_conversation_too_long_is_truncated_from_its_oldest_turns(
    client: openai.AsyncOpenAI,
) -> None:
    result = await Runner.run(
        agent(OpenAIResponsesModel("echo", client)), list(TURNS), run_config=NO_TRACES
    )
    said = result.final_output
    assert isinstance(said, str)
    # the instructions stay; the oldest turns went, the rest follow in order
    assert said.startswith(f"[system]{INSTRUCTIONS}[")
    first = next(i for i, turn in enumerate(TURNS) if f"]m{i} " in said)
    assert first > 0
    assert all(f"]m{i} " not in said for i in range(first))
    # ... exactly as many as had to go: one turn more would not fit, as a request without
    # truncation says
    fitted = await client.responses.create(
        model="echo",
        instructions=INSTRUCTIONS,
        input=TURNS[first:],
        max_output_tokens=ROOM,
        reasoning={"effort": "low"},
    )
    assert fitted.output_text == said
    assert fitted.truncation == "disabled"
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.responses.create(
            model="echo",
            instructions=INSTRUCTIONS,
            input=TURNS[first - 1 :],
            max_output_tokens=ROOM,
            reasoning={"effort": "low"},
        )
    assert too_long.value.body["param"] in ("input", "max_output_tokens")  # type: ignore[index]


async def test_the_agents_sdk_over_chat_sends_the_same_effort(client: openai.AsyncOpenAI) -> None:
    result = await Runner.run(
        agent(OpenAIChatCompletionsModel("echo", client)), "Hello there.", run_config=NO_TRACES
    )
    [reasoning] = [item for item in result.new_items if isinstance(item, ReasoningItem)]
    assert reasoning_text(reasoning) == "effort low"
    assert [type(item) for item in result.new_items] == [ReasoningItem, MessageOutputItem]
    assert result.final_output == f"[system]{INSTRUCTIONS}[user]Hello there."


async def test_truncation_keeps_the_stored_conversation_whole(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(
        model="echo", instructions=INSTRUCTIONS, input=TURNS[:3], max_output_tokens=ROOM
    )
    later = await client.responses.create(
        model="echo",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=TURNS[3:],
        max_output_tokens=ROOM,
        truncation="auto",
    )
    assert later.truncation == "auto"
    assert "]m0 " not in later.output_text  # truncated for the model...
    listed = await client.responses.input_items.list(later.id, limit=100, order="asc")
    kinds = [item.type for item in listed.data]
    assert kinds.count("message") == 13  # ... not in the record: 12 turns, the first answer
    with pytest.raises(openai.BadRequestError) as refused:  # without truncation: too long
        await client.responses.create(
            model="echo",
            instructions=INSTRUCTIONS,
            previous_response_id=first.id,
            input=TURNS[3:],
            max_output_tokens=ROOM,
        )
    assert refused.value.body["param"] in ("input", "max_output_tokens")  # type: ignore[index]
