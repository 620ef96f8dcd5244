"""One large body never stalls the other clients, on any edge (issue 34, failure 5).

A body of 250k items (turns, input items, ids) or 20k tools takes a second or more to
parse and validate; every edge does that in a worker thread (``host.offload``), so a
small request from another client is answered meanwhile. Each big body here ends in a
field error, so that once parsed it is answered at once: had it been parsed on the event
loop, its 400 would be written before the small request could even start (the receive
hands the whole body over without suspending), and the events say which came first.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, MutableMapping
from typing import Any

import anyio
import orjson
import pytest

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()
N = 250_000
JSON = [(b"content-type", b"application/json")]


def turns(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(n)]


def tools(n: int, flat: bool) -> list[dict[str, Any]]:
    if flat:  # Responses' shape
        return [{"type": "function", "name": f"f{i}"} for i in range(n)]
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


#: (path, a big body that is wrong only at its end, the field its 400 names)
BIG = {
    "chat-turns": ("/v1/chat/completions", {"messages": turns(N), "max_tokens": 0}, "max_tokens"),
    "chat-tools": (
        "/v1/chat/completions",
        {"messages": turns(1), "tools": tools(20_000, False), "max_tokens": 0},
        "max_tokens",
    ),
    "responses-items": (
        "/v1/responses",
        {"input": turns(N), "temperature": 5},
        "temperature",
    ),
    "responses-tools": (
        "/v1/responses",
        {"input": "hi", "tools": tools(20_000, True), "temperature": 5},
        "temperature",
    ),
    "messages-turns": (
        "/v1/messages",
        {"model": "echo", "messages": turns(N), "max_tokens": 0},
        "max_tokens",
    ),
    "count-tokens-turns": (
        "/v1/messages/count_tokens",
        {"model": "echo", "messages": turns(N), "tool_choice": 5},  # (after the turns)
        "tool_choice",
    ),
    "tokenize-turns": ("/tokenize", {"messages": turns(N), "return_token_strs": 1}, "return"),
    "detokenize-ids": ("/detokenize", {"tokens": [7] * 5_000_000, "model": 5}, "model"),
}


@pytest.fixture(scope="module")
def app() -> Any:
    return build_app(EchoEngine.from_tokenizer(TOKENIZER), TOKENIZER, model_name="echo")


@pytest.fixture(autouse=True)
def serve_switch_interval() -> Iterator[None]:
    """As ``serve`` runs: the loop waits at most 1 ms for the GIL a worker thread holds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    yield
    sys.setswitchinterval(before)


class Exchange:
    """One request through the app, raw ASGI: its events and what came back."""

    def __init__(self, path: str, body: bytes) -> None:
        self.scope = {"type": "http", "method": "POST", "path": path, "headers": JSON}
        self.body = body
        self.read = anyio.Event()
        self.done = anyio.Event()
        self.status = 0
        self.answer = b""

    async def receive(self) -> MutableMapping[str, Any]:
        if not self.read.is_set():
            self.read.set()
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.answer += message.get("body", b"")
            if not message.get("more_body", False):
                self.done.set()

    async def run(self, app: Any) -> None:
        await app(self.scope, self.receive, self.send)


@pytest.mark.time_limit(120)
@pytest.mark.parametrize("case", sorted(BIG))
async def test_a_small_request_is_answered_while_a_big_body_is_parsed(app: Any, case: str) -> None:
    path, body, param = BIG[case]
    big = Exchange(path, orjson.dumps(body))
    small = Exchange("/tokenize", orjson.dumps({"prompt": "hello"}))
    async with anyio.create_task_group() as tg:
        tg.start_soon(big.run, app)
        await big.read.wait()  # the app has the whole big body
        await small.run(app)
        assert small.status == 200
        assert orjson.loads(small.answer)["count"] > 0
        assert not big.done.is_set()  # answered while the big one was still being parsed
        await big.done.wait()
    assert big.status == 400, big.answer[:300]
    error = orjson.loads(big.answer)["error"]
    named = error["param"] if "param" in error else error["message"]
    assert param in named  # (Anthropic names the field in its message)
