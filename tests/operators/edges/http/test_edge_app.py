"""The app every edge is served by: routes (exact and ``{name}`` templates), 405s naming the
allowed methods, the endpoint labels in the metrics, and a quiet stream's keep-alive."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import orjson

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.edges.anthropic import AnthropicEdge
from operators.edges.http.asgi import send_json
from operators.edges.http.routes import Call, Host, Route
from operators.edges.openai.errors import OPENAI_ERRORS
from operators.edges.openai.server import OpenAIApp
from operators.graph import default_graph
from operators.text.tokenizer import Tokenizer
from pipeline import Context, FunctionEngine

TOKENIZER = Tokenizer.default()


class Items:
    """A user's edge with a template route: ``GET``/``DELETE /v1/items/{item}``."""

    def routes(self, host: Host) -> list[Route]:
        async def show(call: Call) -> int:
            body = {"item": call.params["item"], "method": call.method, "model": host.model_name}
            await send_json(call.send, 200, orjson.dumps(body))
            return 200

        both = frozenset({"GET", "DELETE"})
        return [Route("/v1/items/{item}", both, show, OPENAI_ERRORS, label="/v1/items/{item}")]


def app_with(*edges: Any, engine: Any = None) -> OpenAIApp:
    async def say_hi(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        for token in TOKENIZER.encode("hi"):
            yield EngineOutput([token])

    engine = FunctionEngine(say_hi) if engine is None else engine
    graph = default_graph(engine, TOKENIZER, model_name="m")
    return OpenAIApp(graph, model_name="m", edges=edges)


async def test_a_template_route_gets_its_parameters_and_its_own_label() -> None:
    app = app_with(Items())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as h:
        got = await h.get("/v1/items/42")
        deleted = await h.delete("/v1/items/x-1")
        wrong = await h.post("/v1/items/42")
        deeper = await h.get("/v1/items/42/more")
        chat_get = await h.get("/v1/chat/completions")
        metrics = (await h.get("/metrics")).text
    assert got.json() == {"item": "42", "method": "GET", "model": "m"}
    assert deleted.json()["method"] == "DELETE"
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "DELETE, GET"
    assert deeper.status_code == 404
    assert chat_get.status_code == 405
    assert chat_get.headers["allow"] == "POST"
    assert 'endpoint="/v1/items/{item}",model="",status="200"} 2.0' in metrics
    assert 'endpoint="/v1/items/{item}",model="",status="405"} 1.0' in metrics
    assert 'endpoint="other",model="",status="404"} 1.0' in metrics


async def test_a_quiet_stream_gets_pings_after_its_start_and_never_before() -> None:
    """The engine answers only once the client has seen three pings: written while the
    stream waited, after message_start."""
    release = anyio.Event()

    async def slow(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        await release.wait()  # a long prefill
        yield EngineOutput([TOKENIZER.encode("ok")[0]], finish_reason="stop")

    app = app_with(AnthropicEdge(ping_interval=0.01), engine=FunctionEngine(slow))
    body = {
        "model": "m",
        "max_tokens": 5,
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    written: list[bytes] = []
    done = anyio.Event()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            written.append(message["body"])
            if b"".join(written).count(b"event: ping") >= 3:
                release.set()
            if not message.get("more_body", False):
                done.set()

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/messages",
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    text = b"".join(written).decode()
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start"
    pings = names.count("ping")
    assert pings >= 3  # the first with message_start, the others while waiting
    assert names[1 : 1 + pings] == ["ping"] * pings
    assert names[1 + pings :] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
