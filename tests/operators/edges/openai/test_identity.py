"""Request identity: a client's ``x-request-id`` becomes the request's id, and every
response, streamed or not, says which request it answers; headers reach ``ctx.metadata``."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from operators.contracts.llm import EngineOutput
from operators.edges.openai.server import OpenAIApp
from operators.graph import default_graph
from operators.text.tokenizer import Tokenizer
from pipeline.testing import ScriptedEngine

TOKENIZER = Tokenizer.default()


def make() -> tuple[OpenAIApp, ScriptedEngine[EngineOutput], openai.AsyncOpenAI]:
    engine = ScriptedEngine([EngineOutput([i]) for i in TOKENIZER.encode("ok then")])
    app = OpenAIApp(default_graph(engine, TOKENIZER, model_name="m"), model_name="m")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
    client = openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="secret-key", max_retries=0, http_client=http
    )
    return app, engine, client


@pytest.mark.parametrize("stream", [False, True])
async def test_the_clients_request_id_is_the_requests_id(stream: bool) -> None:
    _, engine, client = make()
    async with client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=stream,
            extra_headers={"x-request-id": "trace-42:a.b_c", "x-tenant": "blue"},
        )
        parsed: Any = raw.parse()
        chunks = [chunk async for chunk in parsed] if stream else [parsed]
        first = chunks[0]
    assert raw.headers["x-request-id"] == "trace-42:a.b_c"
    assert first.id == "chatcmpl-trace-42:a.b_c"
    (ctx,) = engine.requests
    assert ctx.id == "trace-42:a.b_c"
    assert ctx.metadata["x-tenant"] == "blue"
    assert "authorization" not in ctx.metadata  # credentials stay out


@pytest.mark.parametrize("stream", [False, True])
async def test_without_one_the_server_names_the_request(stream: bool) -> None:
    _, engine, client = make()
    async with client:
        raw = await client.completions.with_raw_response.create(
            model="m", prompt="hi", stream=stream
        )
        parsed: Any = raw.parse()
        chunks = [chunk async for chunk in parsed] if stream else [parsed]
        first = chunks[0]
    (ctx,) = engine.requests
    assert raw.headers["x-request-id"] == ctx.id
    assert first.id == f"cmpl-{ctx.id}"


@pytest.mark.parametrize("value", ["has space", "a" * 129, "semi;colon", "ü"])
async def test_a_malformed_request_id_is_a_400_naming_the_header(value: str) -> None:
    app, engine, _ = make()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
        response = await http.post(
            "/completions",
            json={"model": "m", "prompt": "hi"},
            headers={"x-request-id": value.encode()},
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-request-id"
    assert engine.requests == []


async def test_an_error_response_names_the_request_too() -> None:
    _, _, client = make()
    async with client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(
                model="m",
                prompt=[[10**9]],  # a token id outside the vocabulary
                extra_headers={"x-request-id": "r1"},
            )
    assert caught.value.response.headers["x-request-id"] == "r1"
