"""The Responses, Messages and embeddings edges on the real model: ``llm-pipeline serve
--engine llama`` driven by the official ``openai`` and ``anthropic`` clients.

Structured output (``text.format``) and forced tool use (``tool_choice``) are honoured by
constrained decoding, so even SmolLM2-135M's answers validate against their schemas; its
embeddings (the mean of its tokens' hidden states) have 576 numbers, the same alone or in a
batch, and over NATS a worker computes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.time_limit(120)]

llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")

MODEL = "SmolLM2-135M-Instruct"
CITY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def llama() -> Iterator[ServerProcess]:
    server = ServerProcess("--engine", "llama", "--threads", "1", startup_timeout=60)
    yield server
    server.stop()


def openai_api(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


async def test_responses_text_format_json_schema_is_valid_json_of_the_schema(
    llama: ServerProcess,
) -> None:
    async with openai_api(llama) as api:
        response = await api.responses.create(
            model=MODEL,
            input="Name a large city and its population.",
            text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
            temperature=0,
            max_output_tokens=80,
        )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)


async def test_responses_forced_tool_use_is_a_valid_call(llama: ServerProcess) -> None:
    tool: Any = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    async with openai_api(llama) as api:
        response = await api.responses.create(
            model=MODEL,
            input=ASK,
            tools=[tool],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=80,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert [call.name for call in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        answer = await api.responses.create(
            model=MODEL,
            previous_response_id=response.id,
            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}],
            tools=[tool],
            temperature=0,
            max_output_tokens=40,
        )
    assert answer.status in ("completed", "incomplete")
    assert answer.usage is not None
    assert answer.usage.input_tokens > response.usage.input_tokens  # type: ignore[union-attr]


async def test_messages_forced_tool_use_is_a_valid_tool_use_block(llama: ServerProcess) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=llama.url, api_key="x", max_retries=0, timeout=120
    ) as api:
        message = await api.messages.create(
            model=MODEL,
            max_tokens=80,
            messages=[{"role": "user", "content": ASK}],
            tools=[{"name": "get_weather", "input_schema": WEATHER}],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 0},
        )
        count = await api.messages.count_tokens(
            model=MODEL,
            messages=[{"role": "user", "content": ASK}],
            tools=[{"name": "get_weather", "input_schema": WEATHER}],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [use.name for use in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER)
    assert message.stop_reason == "tool_use"
    cached = message.usage.cache_read_input_tokens or 0
    assert message.usage.input_tokens + cached == count.input_tokens


async def test_embeddings_have_576_numbers_the_same_alone_and_batched(
    llama: ServerProcess,
) -> None:
    texts = ["The cat sat on the mat.", "Paris is the capital of France.", "A cat on a mat."]
    async with openai_api(llama) as api:
        batched = await api.embeddings.create(model=MODEL, input=texts)  # base64 by default
        alone = [
            (await api.embeddings.create(model=MODEL, input=text, encoding_format="float"))
            .data[0]
            .embedding
            for text in texts
        ]
        again = await api.embeddings.create(model=MODEL, input=texts[::-1])
    vectors = [item.embedding for item in batched.data]
    assert [len(vector) for vector in vectors] == [576, 576, 576]
    assert vectors == alone  # float32 through base64 and through JSON: the same numbers
    assert [item.embedding for item in again.data][::-1] == vectors
    assert batched.usage.prompt_tokens > 0

    def cosine(a: list[float], b: list[float]) -> float:
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        return dot / (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5

    # the two sentences about a cat on a mat are closer than either is to Paris
    assert cosine(vectors[0], vectors[2]) > max(
        cosine(vectors[0], vectors[1]), cosine(vectors[2], vectors[1])
    )


@pytest.mark.time_limit(120)
async def test_a_llama_worker_serves_embeddings_over_nats(tmp_path: Path) -> None:
    pytest.importorskip("nats", reason="needs the nats extra")
    from tests.helpers.nats_server import NatsServer
    from tests.operators.cli.test_cli_nats import WorkerProcess, wait_for

    nats = NatsServer(tmp_path)
    nats.start()
    worker = None
    frontend = None
    try:
        worker = WorkerProcess(nats.url, "llama-1", "--engine", "llama", "--threads", "1")
        worker.wait_ready(60)
        frontend = ServerProcess("--nats", nats.url, "--model-name", MODEL, "--log-level", "info")
        wait_for(lambda: "worker llama-1 joined" in frontend.stderr(), 10)  # type: ignore[union-attr]
        async with openai_api(frontend) as api:
            remote = await api.embeddings.create(model=MODEL, input=["hello world", "bye"])
            with pytest.raises(openai.BadRequestError) as refused:
                await api.embeddings.create(model=MODEL, input=[[1] * 600])
        local = ServerProcess("--engine", "llama", "--threads", "1", startup_timeout=60)
        try:
            async with openai_api(local) as api:
                here = await api.embeddings.create(model=MODEL, input=["hello world", "bye"])
        finally:
            local.stop()
    finally:
        if frontend is not None:
            frontend.stop()
        if worker is not None:
            worker.stop()
        nats.stop()
    assert [item.embedding for item in remote.data] == [item.embedding for item in here.data]
    assert refused.value.body["param"] == "input"  # type: ignore[index]


async def test_tokenize_counts_the_real_models_prompt(llama: ServerProcess) -> None:
    import httpx

    messages = [{"role": "user", "content": ASK}]
    async with httpx.AsyncClient(base_url=llama.url, timeout=60) as http:
        counted = (await http.post("/tokenize", json={"messages": messages})).json()
    async with openai_api(llama) as api:
        reply = await api.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=1,
        )
    assert reply.usage is not None
    assert counted["count"] == reply.usage.prompt_tokens
    assert counted["max_model_len"] == 2048  # the engine's context, as no --max-model-len
