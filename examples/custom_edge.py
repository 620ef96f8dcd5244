"""An API edge of your own: ``POST /v1/plain`` takes ``{"prompt": ...}``, streams the answer's text.

An edge is two halves and nothing else: a parser (its body, through the shared schema, as
every built-in edge parses: a wrong type is a 400 naming the field, a large body is parsed
off the event loop) that says what the graph takes (here a chat request), and a renderer
(how the graph's typed events become its wire format: here one ``data: {"text": ...}``
event per piece of text, then ``event: done``). Admission, deadlines, request ids,
disconnects, the drain, metrics, migration, the stop jail and the parsers come from the
app and the graph, as for every built-in edge. Run it:

    python examples/custom_edge.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import httpx
import orjson

from operators.edges.http.failures import ApiError
from operators.edges.http.routes import Call, Exchange, Host, Route
from operators.edges.http.schema import Bool, Model, parse_body
from operators.edges.openai.errors import OPENAI_ERRORS
from operators.edges.openai.events import ChoiceDelta, OpenAIEvent, Usage
from operators.edges.openai.protocol import ChatCompletionRequest, parse_chat_request
from operators.engines import EchoEngine
from operators.serving import build_app
from operators.text.tokenizer import Tokenizer


class PlainReply:
    """The rendering half: each piece of text as one event, the answer whole as JSON."""

    def __init__(self) -> None:
        self.output_tokens = 0  # (for the metrics: the usage's count, once it went by)

    def start(self, first: OpenAIEvent) -> Callable[[OpenAIEvent], bytes]:
        return self.render

    def render(self, event: OpenAIEvent) -> bytes:
        if isinstance(event, Usage):
            self.output_tokens = event.completion_tokens
        if isinstance(event, ChoiceDelta) and event.text:
            return b"data: " + orjson.dumps({"text": event.text}) + b"\n\n"
        return b""

    def visible(self, event: OpenAIEvent) -> bool:
        return isinstance(event, ChoiceDelta) and bool(event.text)

    async def end(self) -> bytes:
        return b"event: done\ndata: {}\n\n"

    def failure(self, error: ApiError) -> bytes:
        return b"event: error\ndata: " + orjson.dumps({"message": error.message}) + b"\n\n"

    async def body(self, events: list[Any]) -> bytes:
        self.output_tokens = next(e.completion_tokens for e in events if isinstance(e, Usage))
        text = "".join(e.text for e in events if isinstance(e, ChoiceDelta))
        return orjson.dumps({"text": text})


class PlainRequest(Model):
    """The body: a prompt, and whether to stream."""

    prompt: str
    stream: Bool = False


def parse_plain(body: bytes) -> tuple[PlainRequest, ChatCompletionRequest]:
    """The parsing half: the body, and the one-message chat it becomes."""
    request = parse_body(PlainRequest, body)
    chat = {"messages": [{"role": "user", "content": request.prompt}]}
    return request, parse_chat_request(chat)


class PlainEdge:
    """The route: the parser, the renderer, and the host that runs the rest."""

    def routes(self, host: Host) -> list[Route]:
        async def answer(call: Call) -> int:
            async def prepare(body: bytes) -> Exchange:
                request, chat = await host.offload(len(body), parse_plain, body)
                return Exchange(chat, request.stream, PlainReply())

            return await host.generate(call, prepare, OPENAI_ERRORS)

        return [Route("/v1/plain", frozenset({"POST"}), answer, OPENAI_ERRORS)]


async def main() -> None:
    tokenizer = Tokenizer.default()
    engine = EchoEngine.from_tokenizer(tokenizer)
    template = "{{ messages[-1]['content'] }}"  # the echo engine says the prompt back
    app = build_app(
        engine, tokenizer, model_name="echo", chat_template=template, edges=[PlainEdge()]
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
        whole = await http.post("/v1/plain", json={"prompt": "Hello, plain world"})
        print("whole:", whole.json())
        streamed = await http.post("/v1/plain", json={"prompt": "Hi there", "stream": True})
        print("streamed:", streamed.text.replace("\n\n", " | ").replace("\n", " ").strip(" |"))
        metrics = (await http.get("/metrics")).text
    served = [line for line in metrics.splitlines() if 'endpoint="/v1/plain"' in line]
    print("counted:", served[0].split("{")[1])


if __name__ == "__main__":
    anyio.run(main)
