"""Reasoning budgets on the real model: ``llm-pipeline serve --engine llama`` driven by the
official ``anthropic`` and ``openai`` clients.

SmolLM2 does not reason on its own, so the test puts it inside its reasoning from the start:
a chat template whose generation prompt opens ``<think>`` (as DeepSeek R1's and Qwen 3
thinking models' do), with a reasoning format that starts inside the reasoning. Left alone
it never writes ``</think>``: everything it says is reasoning. With a budget, the engine
forces ``</think>`` once the budget is spent, and what follows is the answer. Turning
thinking off is seen on a Qwen 3 style template, which closes an empty reasoning block in
the prompt when ``enable_thinking`` is false.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from operators.text.tokenizer import Tokenizer
from tests.helpers.server_process import ServerProcess

pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.time_limit(180)]

llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")

#: the repository's root, on the server's PYTHONPATH for ``tests.helpers.open_think``
ROOT = str(Path(__file__).resolve().parents[3])
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
)
#: the generation prompt opens the reasoning
OPENED = CHATML + "<think>\n{% endif %}"
#: Qwen 3's way: thinking off closes an empty reasoning block in the prompt
HYBRID = (
    CHATML + "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
#: the tokens of the end marker the engine forces
END_MARKER = len(Tokenizer.default().encode("</think>", add_special_tokens=False))
BUDGET = 12
QUESTION = [{"role": "user", "content": "Explain in detail, step by step, how a car engine works."}]


def serve(tmp_path: Path, template: str, parser: str) -> ServerProcess:
    path = tmp_path / "template.jinja"
    path.write_text(template)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        return ServerProcess(
            "--engine",
            "llama",
            "--threads",
            "1",
            "--chat-template",
            str(path),
            "--reasoning-parser",
            parser,
            startup_timeout=60,
        )


@pytest.fixture(scope="module")
def opened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = serve(tmp_path_factory.mktemp("opened"), OPENED, "tests.helpers.open_think:OPEN_THINK")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = serve(tmp_path_factory.mktemp("hybrid"), HYBRID, "think")
    yield server
    server.stop()


def claude(server: ServerProcess) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def gpt(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


async def test_left_alone_the_model_never_ends_its_reasoning(opened: ServerProcess) -> None:
    async with gpt(opened) as api:
        chat = await api.chat.completions.create(
            model=opened.model,
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=40,
            temperature=0,
        )
    message: Any = chat.choices[0].message
    assert chat.choices[0].finish_reason == "length"
    assert message.reasoning_content
    assert not message.content
    assert chat.usage is not None
    assert chat.usage.completion_tokens_details is not None
    assert chat.usage.completion_tokens_details.reasoning_tokens == 40


async def test_a_thinking_budget_ends_the_reasoning_and_the_answer_follows(
    opened: ServerProcess,
) -> None:
    request: Any = {
        "model": opened.model,
        "max_tokens": 48,
        "messages": QUESTION,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        "extra_body": {"temperature": 0},  # (this SDK no longer sends it itself)
    }
    async with claude(opened) as api:
        whole = await api.messages.create(**request)
        async with api.messages.stream(**request) as stream:
            streamed = await stream.get_final_message()
    for message in (whole, streamed):
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking: Any = message.content[0]
        text: Any = message.content[1]
        assert thinking.thinking.strip()
        assert text.text.strip()  # the answer, after the reasoning the budget ended
        assert "</think>" not in thinking.thinking + text.text
    said = [
        [block.model_dump(include={"type", "thinking", "text"}) for block in m.content]
        for m in (whole, streamed)
    ]
    assert said[0] == said[1]  # (greedy: the same tokens, streamed or not)


async def test_the_budget_bounds_the_reasoning_tokens(opened: ServerProcess) -> None:
    async with gpt(opened) as api:
        chat = await api.chat.completions.create(
            model=opened.model,
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=48,
            temperature=0,
            extra_body={"thinking_token_budget": BUDGET},
        )
        # Responses' effort, where the template does not read it: a share of the output
        # limit (low: 20 % of 60 = 12 tokens), the same budget
        response = await api.responses.create(
            model=opened.model,
            input=QUESTION[0]["content"],
            max_output_tokens=60,
            temperature=0,
            reasoning={"effort": "low"},
        )
    assert chat.usage is not None
    details = chat.usage.completion_tokens_details
    assert details is not None
    assert details.reasoning_tokens is not None
    assert BUDGET <= details.reasoning_tokens <= BUDGET + END_MARKER
    message: Any = chat.choices[0].message
    assert message.reasoning_content
    assert message.content
    assert response.usage is not None
    reasoned = response.usage.output_tokens_details.reasoning_tokens
    assert BUDGET <= reasoned <= BUDGET + END_MARKER
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text.strip()


async def test_thinking_disabled_turns_reasoning_off_through_the_template(
    hybrid: ServerProcess,
) -> None:
    request: Any = {"model": hybrid.model, "messages": QUESTION}
    async with claude(hybrid) as api:
        message = await api.messages.create(**request, max_tokens=24, thinking={"type": "disabled"})
        plain = await api.messages.count_tokens(**request)
        disabled = await api.messages.count_tokens(**request, thinking={"type": "disabled"})
    assert [block.type for block in message.content] == ["text"]
    # the template closed an empty reasoning block in the prompt: "<think>\n\n</think>\n\n"
    assert disabled.input_tokens > plain.input_tokens


async def test_a_budget_the_model_cannot_keep_is_refused_by_name(hybrid: ServerProcess) -> None:
    """A budget beside a constraint: the constraint holds for the whole output."""
    async with gpt(hybrid) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            await api.chat.completions.create(
                model=hybrid.model,
                messages=QUESTION,  # type: ignore[arg-type]
                max_tokens=24,
                response_format={"type": "json_object"},
                extra_body={"thinking_token_budget": BUDGET},
            )
    assert refused.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
