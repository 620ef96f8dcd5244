"""The real model over HTTP: ``llm-pipeline serve --engine llama`` with the official client."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from operators.text.tokenizer import Tokenizer
from tests.helpers.server_process import ServerProcess

pytestmark = [pytest.mark.llama, pytest.mark.slow]

llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REPEAT = [
    {
        "role": "user",
        "content": "Repeat exactly: the red fox runs over the green hill and the red fox "
        "runs over the green hill and the red fox runs over the green hill",
    }
]


@pytest.fixture(scope="module")
def llama() -> Iterator[ServerProcess]:
    server = ServerProcess("--engine", "llama", "--threads", "1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def speculative() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "--engine", "llama", "--threads", "1", "--speculative", "ngram", "--ngram-size", "3"
    )
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


async def greedy(server: ServerProcess, messages: list[Any], **extra: Any) -> Any:
    async with client(server) as api:
        return await api.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16, **extra
        )


async def test_chat_answers_with_text_and_correct_usage(llama: ServerProcess) -> None:
    response = await greedy(llama, QUESTION)
    text = response.choices[0].message.content
    assert text
    assert text.strip()
    assert response.model == MODEL
    tokenizer = Tokenizer.default()
    prompt = tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert response.usage.prompt_tokens == len(prompt)
    assert 0 < response.usage.completion_tokens <= 16
    assert response.usage.total_tokens == len(prompt) + response.usage.completion_tokens


async def test_a_chats_next_turn_reports_its_cached_prompt_tokens(llama: ServerProcess) -> None:
    first = await greedy(llama, QUESTION)
    details = first.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    assert details.cached_tokens < first.usage.prompt_tokens
    follow_up = [
        *QUESTION,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = await greedy(llama, follow_up)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the slot still holds the first turn's prompt (and the answer's tokens fed back)
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


async def test_greedy_is_deterministic_and_unchanged_by_speculation(
    llama: ServerProcess, speculative: ServerProcess
) -> None:
    first = await greedy(llama, REPEAT)
    second = await greedy(llama, REPEAT)
    spec = await greedy(speculative, REPEAT)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert spec.choices[0].message.content == first.choices[0].message.content
    # (what each server's slots had cached before differs, the counts do not)
    assert (spec.usage.prompt_tokens, spec.usage.completion_tokens) == (
        first.usage.prompt_tokens,
        first.usage.completion_tokens,
    )
    proposed = await metric(speculative, "llm_pipeline_speculative_proposed_tokens_total")
    accepted = await metric(speculative, "llm_pipeline_speculative_accepted_tokens_total")
    assert 0 < accepted <= proposed


async def test_max_tokens_and_stop_strings_behave_as_with_echo(llama: ServerProcess) -> None:
    full = await greedy(llama, REPEAT)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = await greedy(llama, REPEAT, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


async def test_logprobs_are_present_and_aligned(llama: ServerProcess) -> None:
    response = await greedy(llama, QUESTION, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


async def metric(server: ServerProcess, name: str) -> float:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


async def test_disconnect_stops_generation(llama: ServerProcess) -> None:
    body = {"model": MODEL, "messages": REPEAT, "stream": True, "max_tokens": 500}
    async with httpx.AsyncClient(base_url=llama.base_url, timeout=60) as http:
        async with http.stream("POST", "/chat/completions", json=body) as response:
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data: ")
                if lines == 3:
                    break
    # An external process: poll its gauge, bounded (the server notices on its next write).
    for _ in range(200):
        if await metric(llama, "llm_pipeline_inflight_requests") == 0.0:
            break
        await anyio.sleep(0.05)
    assert await metric(llama, "llm_pipeline_inflight_requests") == 0.0
    # The model is free again at once: a new short request completes promptly.
    with anyio.fail_after(10):
        response = await greedy(llama, QUESTION)
    assert response.choices[0].message.content


async def test_two_concurrent_requests_both_complete(llama: ServerProcess) -> None:
    results: dict[int, str] = {}

    async def one(index: int) -> None:
        response = await greedy(llama, QUESTION if index == 0 else REPEAT)
        results[index] = response.choices[0].message.content

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        tg.start_soon(one, 1)
    assert results[0] == (await greedy(llama, QUESTION)).choices[0].message.content
    assert results[1] == (await greedy(llama, REPEAT)).choices[0].message.content


async def test_concurrent_requests_are_batched_and_the_metrics_say_so(
    llama: ServerProcess,
) -> None:
    steps_before = await metric(llama, "llm_pipeline_llama_batch_size_count")
    decoded_before = await metric(llama, "llm_pipeline_llama_decode_tokens_total")
    alone = [
        (await greedy(llama, messages)).choices[0].message.content
        for messages in (QUESTION, REPEAT)
    ]
    together: dict[int, str] = {}

    async def one(index: int) -> None:
        response = await greedy(llama, QUESTION if index == 0 else REPEAT)
        together[index] = response.choices[0].message.content

    async with anyio.create_task_group() as tg:
        for index in range(2):
            tg.start_soon(one, index)
    assert [together[0], together[1]] == alone  # batch invariance, through the whole graph
    assert await metric(llama, "llm_pipeline_llama_batch_size_count") > steps_before
    assert await metric(llama, "llm_pipeline_llama_decode_tokens_total") > decoded_before
    assert await metric(llama, "llm_pipeline_llama_prefill_tokens_total") > 0
    assert await metric(llama, "llm_pipeline_llama_running_sequences") == 0.0
    assert await metric(llama, "llm_pipeline_llama_waiting_sequences") == 0.0
    # steps of two sequences happened (le="1.0" counts the one-sequence steps only)
    one_sequence = await metric(llama, 'llm_pipeline_llama_batch_size_bucket{le="1.0"}')
    assert await metric(llama, "llm_pipeline_llama_batch_size_count") > one_sequence
