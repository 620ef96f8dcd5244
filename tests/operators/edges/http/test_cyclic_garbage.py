"""A request leaves nothing in a reference cycle, whichever way it ends.

A server collects cyclic garbage rarely (:func:`operators.cli.tuning.tune_gc` raises the
threshold to 50,000 allocations), so what each request leaves in a cycle stays resident
for thousands of requests: it was ~70 objects a request (the disconnect watcher cancelled
through its task group, the cancellation controllers of a request's legs, a first span
pointing at itself), megabytes of memory between collections. Each path below runs a few
requests through the whole app (the web UI's span buffer on, so every stage is traced)
with the collector off, then collects: nothing may be found. The requests go straight to
the ASGI app: an HTTP client's own cycles (httpx's) would be counted with the server's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.edges.openai.server import OpenAIApp
from operators.engines.echo import EchoEngine
from operators.serving import build_app
from operators.text.tokenizer import Tokenizer
from pipeline import Context, FunctionEngine
from tests.helpers.asgi_call import call_asgi
from tests.helpers.garbage import cyclic_garbage

TOKENIZER = Tokenizer.default()
#: requests before the measured ones: more than the UI's span buffer keeps (50), so that
#: each measured request pushes an older one's spans out, and they are freed then
WARM_UP = 60
#: requests measured per path
REQUESTS = 10
#: the prompt of a request whose client leaves once its first token is out
LEAVING = "x"


@dataclass
class Served:
    """The app under test, and the disconnect of the request in flight (a fresh event for
    each request): the engine sets it when the client is to leave."""

    app: OpenAIApp = field(init=False)
    gone: anyio.Event = field(default_factory=anyio.Event)


Request = Callable[[Served, int], Awaitable[list[dict[str, Any]]]]


def chat(stream: bool) -> Request:
    async def send(served: Served, i: int) -> list[dict[str, Any]]:
        body = {"model": "echo", "max_tokens": 8, "stream": stream}
        body["messages"] = [{"role": "user", "content": f"request {i}"}]
        return await call_asgi(served.app, "/v1/chat/completions", body)

    return send


def post(path: str, body: dict[str, Any]) -> Request:
    async def send(served: Served, i: int) -> list[dict[str, Any]]:
        return await call_asgi(served.app, path, body)

    return send


async def client_gone(served: Served, i: int) -> list[dict[str, Any]]:
    body = {"model": "echo", "messages": [{"role": "user", "content": LEAVING}], "stream": True}
    return await call_asgi(served.app, "/v1/chat/completions", body, served.gone)


def one_token_then(served: Served) -> FunctionEngine[PreprocessedRequest, EngineOutput]:
    """An engine that answers one token, then fails; or, for the leaving client's request,
    lets the client leave and waits until it is cancelled."""

    async def generate(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        yield EngineOutput([TOKENIZER.encode("hi")[0]])
        if ctx.data.token_ids[-1] == TOKENIZER.encode(LEAVING)[0]:
            served.gone.set()
            await anyio.sleep_forever()
        raise RuntimeError("the engine failed")

    return FunctionEngine(generate)


ECHO = "echo"
FAILING = "failing"
MIGRATING = "migrating"

PATHS: dict[str, tuple[str, Request, int]] = {
    # name: (engine, request, status)
    "chat streamed": (ECHO, chat(True), 200),
    "chat not streamed": (ECHO, chat(False), 200),
    "completions streamed": (
        ECHO,
        post("/v1/completions", {"model": "echo", "prompt": "a b", "stream": True}),
        200,
    ),
    "completions not streamed": (ECHO, post("/v1/completions", {"prompt": "a b"}), 200),
    "responses streamed": (
        ECHO,
        post("/v1/responses", {"model": "echo", "input": "hi", "stream": True}),
        200,
    ),
    "anthropic messages streamed": (
        ECHO,
        post(
            "/v1/messages",
            {
                "model": "echo",
                "max_tokens": 8,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
        200,
    ),
    "a 400 (invalid messages)": (
        ECHO,
        post("/v1/chat/completions", {"model": "echo", "messages": "x"}),
        400,
    ),
    "a 404 (unknown model)": (ECHO, post("/v1/completions", {"model": "no", "prompt": "x"}), 404),
    "the client gone mid-stream": (FAILING, client_gone, 200),
    "the engine failing mid-stream": (FAILING, chat(True), 200),
    "the engine failing, not streamed": (FAILING, chat(False), 500),
    "migrated to a second attempt": (MIGRATING, chat(True), 200),
}


def served_by(engine: str) -> Served:
    served = Served()
    if engine == FAILING:
        chosen: Any = one_token_then(served)
    else:
        fail_after = 2 if engine == MIGRATING else None
        chosen = EchoEngine.from_tokenizer(TOKENIZER, fail_after_tokens=fail_after)
    served.app = build_app(chosen, TOKENIZER, model_name="echo", ui=True)
    return served


@pytest.mark.parametrize("path", PATHS)
async def test_a_request_leaves_no_cyclic_garbage(path: str) -> None:
    engine, send, status = PATHS[path]
    served = served_by(engine)

    async def one(i: int) -> None:
        served.gone = anyio.Event()
        sent = await send(served, i)
        assert sent[0]["status"] == status, sent

    for i in range(WARM_UP):  # (and caches filled on first use are not a request's garbage)
        await one(i)
    with cyclic_garbage() as found:
        for i in range(WARM_UP, WARM_UP + REQUESTS):
            await one(i)
    assert served.app.inflight == 0
    assert not found, f"{sum(found.values())} objects in cycles after {REQUESTS} requests: {found}"
