"""Large prompts: prepared off the event loop, refused early when they cannot fit.

A tokenizer whose encode of a large text waits on a gate shows that a small request is
served from start to end while a large one is still being encoded (it runs in a worker
thread), that a client leaving meanwhile is counted and leaves nothing in flight, and that a
prompt whose length alone rules it out is refused with a 400 naming the field before any
encoding. The official ``openai`` client drives the app in-process, and a real server
subprocess refuses a multi-megabyte prompt at once.
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from typing import Any

import anyio
import anyio.to_thread
import httpx
import openai
import orjson
import pytest

from operators.edges.openai import OpenAIPreprocessor
from operators.edges.openai.prompt_size import (
    OFF_LOOP_CHARS,
    PromptSize,
    prompt_sizes,
    refuse_unfittable,
)
from operators.edges.openai.protocol import parse_chat_request, parse_completion_request
from operators.edges.openai.server import OpenAIApp
from operators.engines.echo import EchoEngine
from operators.graph import default_graph
from operators.text.tokenizer import Tokenizer
from pipeline import InvalidRequest
from tests.helpers.server_process import ServerProcess

TOKENIZER = Tokenizer.default()
LARGE = "many words here " * (OFF_LOOP_CHARS // 8)  # twice the off-loop threshold
HUGE = "word " * 50_000  # 250k characters: at least 250k / max_token_chars tokens


class GatedTokenizer(Tokenizer):
    """The shipped tokenizer, except that encoding a text longer than the off-loop
    threshold first sets ``entered`` and waits for ``gate`` (threading events: it runs in
    a worker thread); it counts such encodes."""

    def __init__(self) -> None:
        super().__init__(TOKENIZER.inner, TOKENIZER.metadata)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.large_encodes = 0
        self.threads: set[str] = set()

    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        if len(text) > OFF_LOOP_CHARS:
            self.large_encodes += 1
            self.threads.add(threading.current_thread().name)
            self.entered.set()
            if not self.gate.wait(20):
                raise RuntimeError("the test never opened the gate")
        return super().encode(
            text, add_special_tokens=add_special_tokens, parse_special=parse_special
        )


def make_app(tokenizer: Tokenizer, **options: Any) -> OpenAIApp:
    engine = EchoEngine(special_token_ids=TOKENIZER.special_token_ids | TOKENIZER.eos_token_ids)
    graph = default_graph(engine, tokenizer, model_name="m", **options)
    return OpenAIApp(graph, model_name="m")


def client_for(app: OpenAIApp) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(
        base_url="http://test/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://test/v1"),
    )


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}]} | fields


async def test_a_small_request_is_served_while_a_large_one_is_encoded() -> None:
    tokenizer = GatedTokenizer()
    app = make_app(tokenizer)
    large_done = anyio.Event()
    results: dict[str, Any] = {}

    async with client_for(app) as client:

        async def large() -> None:
            results["large"] = await client.chat.completions.create(**chat(LARGE, max_tokens=3))
            large_done.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(large)
                await anyio.to_thread.run_sync(tokenizer.entered.wait)
                small = await client.completions.create(
                    model="m", prompt="Hello there", max_tokens=5
                )
                assert small.choices[0].text == "Hello there"
                assert not large_done.is_set()  # still waiting at the gate
                tokenizer.gate.set()
    response = results["large"]
    assert response.usage is not None
    assert response.usage.completion_tokens == 3
    (expected,) = OpenAIPreprocessor(TOKENIZER, model_name="m").preprocess(
        parse_chat_request(chat(LARGE))
    )
    assert response.usage.prompt_tokens == expected.prompt_tokens
    assert tokenizer.threads
    assert "MainThread" not in tokenizer.threads


async def test_a_client_leaving_while_its_large_prompt_is_encoded_leaves_nothing() -> None:
    tokenizer = GatedTokenizer()
    app = make_app(tokenizer)
    gone = anyio.Event()
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            body = orjson.dumps(chat(LARGE, stream=True))
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, scope, receive, send)
            await anyio.to_thread.run_sync(tokenizer.entered.wait)
            assert app.inflight == 1
            gone.set()
            await anyio.wait_all_tasks_blocked()  # the watcher has seen the disconnect
            (ctx,) = app.generations.contexts
            assert ctx.is_killed
            tokenizer.gate.set()
    assert app.inflight == 0
    assert sent == []  # nothing was written to a client that had left
    metrics = app.metrics.render().decode()
    assert 'endpoint="/v1/chat/completions",model="m",status="499"} 1.0' in metrics
    assert "llm_pipeline_inflight_requests 0.0" in metrics


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(HUGE), "messages"),
        (chat(HUGE, max_tokens=10), "messages"),
        (chat(LARGE, max_tokens=300), "max_tokens"),
        (chat(LARGE, max_completion_tokens=300), "max_completion_tokens"),
    ],
)
async def test_a_chat_prompt_that_cannot_fit_is_refused_before_encoding(
    body: dict[str, Any], param: str
) -> None:
    tokenizer = GatedTokenizer()
    tokenizer.gate.set()
    limit = 1024
    app = make_app(tokenizer, max_model_len=limit)
    # whatever the exact counts: HUGE alone cannot fit, LARGE cannot with 300 more
    least = -(-len(LARGE) // TOKENIZER.max_token_chars)
    assert least < limit < least + 300
    assert -(-len(HUGE) // TOKENIZER.max_token_chars) >= limit
    async with client_for(app) as client:
        with anyio.fail_after(10), pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**body)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 1024 tokens" in error["message"]
    assert tokenizer.large_encodes == 0


async def test_a_completions_batch_names_the_prompt_that_cannot_fit() -> None:
    app = make_app(TOKENIZER, max_model_len=1024)
    async with client_for(app) as client:
        with anyio.fail_after(10), pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="m", prompt=["short", HUGE], max_tokens=2)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "prompt.1"
    assert "at least" in error["message"]


def test_the_bound_is_a_lower_bound_on_tokens() -> None:
    per_token = 10
    limit = 100

    def refuse(chars: int, **fields: Any) -> None:
        request = parse_chat_request(chat("y" * chars, **fields))
        refuse_unfittable(
            request, prompt_sizes(request), max_model_len=limit, max_token_chars=per_token
        )

    refuse(99 * per_token)  # at least 99 tokens: might fit, left to the exact count
    with pytest.raises(InvalidRequest) as caught:
        refuse(99 * per_token + 1)  # at least 100: no room for a completion
    assert caught.value.param == "messages"
    refuse(90 * per_token, max_tokens=10)  # at least 90 + 10 = 100: might fit
    with pytest.raises(InvalidRequest) as caught:
        refuse(90 * per_token + 1, max_tokens=10)
    assert caught.value.param == "max_tokens"
    # without a context length nothing is refused
    request = parse_chat_request(chat("y" * 10_000))
    refuse_unfittable(request, prompt_sizes(request), max_model_len=None, max_token_chars=1)


def test_token_id_prompts_are_counted_exactly_and_left_to_the_exact_check() -> None:
    request = parse_completion_request({"model": "m", "prompt": [[1, 2, 3], [4, 5, 6, 7]]})
    sizes = prompt_sizes(request)
    assert sizes == [PromptSize("prompt.0", 3, exact=True), PromptSize("prompt.1", 4, exact=True)]
    assert sizes[1].least_tokens(100) == 4
    # left to the exact check, which needs no encoding and words its own message
    refuse_unfittable(request, sizes, max_model_len=4, max_token_chars=100)
    text = parse_completion_request({"model": "m", "prompt": "abcd"})
    assert prompt_sizes(text) == [PromptSize("prompt", 4)]
    assert prompt_sizes(text)[0].least_tokens(3) == 2


def test_images_and_text_parts_count_their_text() -> None:
    request = parse_chat_request(
        {"model": "m", "messages": [
            {"role": "system", "content": "abc"},
            {"role": "user", "content": [
                {"type": "text", "text": "hello"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ]},
            {"role": "assistant", "content": None, "tool_calls": []},
        ]}
    )  # fmt: skip
    assert prompt_sizes(request) == [PromptSize("messages", 8)]


@pytest.mark.slow
def test_the_server_refuses_a_prompt_of_megabytes_at_once() -> None:
    server = ServerProcess("--max-model-len", "2048")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=20)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**chat("word " * 600_000, model=server.model))  # 3 MB
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["param"] == "messages"
        assert "2048 tokens" in error["message"]
        small = client.completions.create(model=server.model, prompt="still here", max_tokens=4)
        assert small.choices[0].text == "still here"
    finally:
        server.stop()
