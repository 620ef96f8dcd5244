"""Every edge's generation requests are traced the same way: one request span (HTTP and
GenAI attributes, the response's own id, the first token, the usage) with the graph's
stages under it, started and ended by the lifecycle the edges share."""

from __future__ import annotations

from typing import Any

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.telemetry import SpanBuffer
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline.tracing import Tracer

TOKENIZER = Tokenizer.default()


def traced() -> tuple[Any, SpanBuffer]:
    buffer = SpanBuffer()
    engine = EchoEngine.from_tokenizer(TOKENIZER)
    app = build_app(engine, TOKENIZER, model_name="echo", tracer=Tracer(buffer))
    return app, buffer


async def test_a_responses_request_and_a_messages_request_are_traced() -> None:
    app, buffer = traced()
    async with openai_client(app) as openai_api:
        response = await openai_api.responses.create(model="echo", input="hi", stream=False)
    async with anthropic_client(app) as anthropic_api:
        async with anthropic_api.messages.stream(
            model="echo", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            message = await stream.get_final_message()
    messages_request, responses_request = buffer.recent()  # newest first
    for recent, route, response_id in (
        (responses_request, "/v1/responses", response.id),
        (messages_request, "/v1/messages", message.id),
    ):
        root = recent.root
        attributes = root.attributes
        assert root.name == f"POST {route}"
        assert attributes["http.route"] == route
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.response.id"] == response_id
        assert attributes["http.response.status_code"] == 200
        assert attributes["gen_ai.usage.output_tokens"] > 0
        assert "first_token" in [event.name for event in root.events]
        assert len(recent.spans) > 1  # the graph's stages hang under it
