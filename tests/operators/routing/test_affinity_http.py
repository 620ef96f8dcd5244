"""A conversation named by ``prompt_cache_key`` or the ``x-session-affinity`` header stays on
one worker of ``serve --router kv``, through every API (the official clients, in-process).

The prompts share no prefix, so only the name can keep them together: what the router's
decisions per worker (``/metrics``) show.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from operators.cli.config import ServeConfig
from operators.cli.model_graph import engine_and_options
from operators.contracts.llm import PreprocessedRequest
from operators.contracts.transport import llm_codec
from operators.edges.http.metrics import ServerMetrics
from operators.edges.openai.server import OpenAIApp
from operators.serving import build_app
from operators.testing import anthropic_client, openai_client
from tests.helpers.router_http import TOKENIZER, changed, parse, scrape

DECISIONS = "llm_pipeline_router_decisions_total"
WORKERS = ("--model-name", "m", "--engine", "echo", "--decode-workers", "4", "--router", "kv")


def app_for(*argv: str) -> OpenAIApp:
    """The app ``serve`` would make (every API) over its in-process workers."""
    metrics = ServerMetrics()
    config = ServeConfig.from_args(parse("serve", *argv))
    engine, options, _ = engine_and_options(config, TOKENIZER, None, None, metrics)
    return build_app(engine, TOKENIZER, model_name="m", metrics=metrics, **options)


async def decided(app: OpenAIApp, call: Any) -> str:
    """The worker ``call()`` was routed to."""
    before = await scrape(app)
    await call()
    [worker] = changed(before, await scrape(app), DECISIONS)
    return worker


def prompt(n: int) -> str:
    """A prompt whose first block is its own (a number first)."""
    return f"{n} " + "unrelated words " * (n % 5 + 4)


def chat(n: int) -> list[Any]:
    """A chat whose first block is its own (the template's head, then a number)."""
    return [{"role": "system", "content": prompt(n)}, {"role": "user", "content": "Hi"}]


async def test_a_prompt_cache_key_keeps_a_chat_on_one_worker() -> None:
    app = app_for(*WORKERS)
    async with openai_client(app) as client:

        def turn(n: int, key: str) -> Any:
            return lambda: client.chat.completions.create(
                model="m",
                messages=chat(n),
                max_tokens=2,
                prompt_cache_key=key,
            )

        places = {key: {await decided(app, turn(n, key)) for n in range(6)} for key in "ab"}
        assert all(len(workers) == 1 for workers in places.values()), places
        # without a key the same prompts go wherever the load says (the random ties)
        free = {
            await decided(
                app,
                lambda n=n: client.chat.completions.create(
                    model="m", messages=chat(n), max_tokens=2
                ),
            )
            for n in range(12)
        }
        assert len(free) > 1


async def test_completions_and_responses_take_the_key_too() -> None:
    app = app_for(*WORKERS)
    async with openai_client(app) as client:
        completions = {
            await decided(
                app,
                lambda n=n: client.completions.create(
                    model="m",
                    prompt=prompt(n),
                    max_tokens=2,
                    extra_body={"prompt_cache_key": "c"},
                ),
            )
            for n in range(5)
        }
        responses = {
            await decided(
                app,
                lambda n=n: client.responses.create(
                    model="m", input=prompt(n), max_output_tokens=16, prompt_cache_key="r"
                ),
            )
            for n in range(5)
        }
    assert len(completions) == 1
    assert len(responses) == 1


async def test_the_header_names_the_conversation_for_any_api() -> None:
    app = app_for(*WORKERS)
    headers = {"x-session-affinity": "h"}
    async with openai_client(app) as client, anthropic_client(app) as claude:
        places = {
            await decided(
                app,
                lambda n=n: client.chat.completions.create(
                    model="m", messages=chat(n), max_tokens=2, extra_headers=headers
                ),
            )
            for n in range(4)
        }
        places |= {
            await decided(
                app,
                lambda n=n: claude.messages.create(
                    model="m",
                    max_tokens=2,
                    system=prompt(n + 10),
                    messages=[{"role": "user", "content": "Hi"}],
                    extra_headers=headers,
                ),
            )
            for n in range(4)
        }
    assert len(places) == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_cache_key": ""}, "prompt_cache_key"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
        ({"prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
    ],
)
async def test_a_bad_key_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    app = app_for(*WORKERS)
    async with openai_client(app) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body=body,
            )
    assert caught.value.body["param"] == param  # type: ignore[index]


async def test_a_bad_header_is_a_400_naming_it() -> None:
    app = app_for(*WORKERS)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-session-affinity": "k" * 1025},
        )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "x-session-affinity"
    async with anthropic_client(app) as claude:
        with pytest.raises(anthropic.BadRequestError, match="x-session-affinity"):
            await claude.messages.create(
                model="m",
                max_tokens=2,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-session-affinity": "k" * 1025},
            )


def test_the_conversation_crosses_the_nats_codec() -> None:
    codec = llm_codec()
    request = PreprocessedRequest(token_ids=[1, 2], affinity="conversation-7")
    assert codec.decode(codec.encode(request)) == request
    assert codec.decode(codec.encode(PreprocessedRequest(token_ids=[1]))).affinity is None
