"""API keys, admission control, deadlines and the end of a drain, as a client sees them.

The official ``openai`` client drives the app in-process (``httpx.ASGITransport``) over a
ScriptedEngine that hangs where a test needs a request to stay in flight; the CLI flags are
checked on a real ``llm-pipeline serve``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from operators.contracts.llm import EngineOutput
from operators.edges.http.guard import Guard
from operators.edges.openai.server import OpenAIApp
from operators.graph import default_graph
from operators.text.tokenizer import Tokenizer
from pipeline import Context, FunctionEngine
from pipeline.testing import ScriptedEngine
from tests.helpers.server_process import ServerProcess

TOKENIZER = Tokenizer.default()
KEY = "sk-test-0123456789"


def outputs(text: str) -> list[EngineOutput]:
    return [EngineOutput([token_id]) for token_id in TOKENIZER.encode(text)]


def make_app(engine: ScriptedEngine[EngineOutput], **guard: Any) -> OpenAIApp:
    graph = default_graph(engine, TOKENIZER, model_name="m")
    return OpenAIApp(graph, model_name="m", guard=Guard(**guard))


def client_for(app: OpenAIApp, api_key: str = "x", **options: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key=api_key, max_retries=0, http_client=http, **options
    )


async def complete(client: openai.AsyncOpenAI, **fields: Any) -> Any:
    return await client.completions.create(model="m", prompt="hi there", **fields)


async def collect_stream(client: openai.AsyncOpenAI) -> list[Any]:
    stream = await client.completions.create(model="m", prompt="hi there", stream=True)
    return [chunk async for chunk in stream]


# -------------------------------------------------------------------------- API keys


@pytest.mark.parametrize("sent", ["wrong-key", KEY + "x", KEY[:-1], " "])
async def test_a_wrong_or_missing_key_is_a_401(sent: str) -> None:
    app = make_app(ScriptedEngine(outputs("ok")), api_keys=[KEY, "another"])
    async with client_for(app, api_key=sent) as client:
        with anyio.fail_after(10), pytest.raises(openai.AuthenticationError) as caught:
            await complete(client)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "invalid_api_key"
    assert error["type"] == "invalid_request_error"
    assert caught.value.response.headers["www-authenticate"] == "Bearer"
    assert 'llm_pipeline_rejected_requests_total{reason="invalid_api_key"} 1.0' in (
        app.metrics.render().decode()
    )


async def test_a_request_without_authorization_is_a_401_and_models_are_guarded() -> None:
    app = make_app(ScriptedEngine(outputs("ok")), api_keys=[KEY])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for path in ("/v1/models", "/v1/models/m"):
            response = await http.get(path)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        basic = await http.get("/v1/models", headers={"authorization": f"Basic {KEY}"})
        assert basic.status_code == 401
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


async def test_every_configured_key_is_accepted_and_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    app = make_app(ScriptedEngine(outputs("ok")), api_keys=[KEY, "another"])
    for key in (KEY, "another"):
        async with client_for(app, api_key=key) as client:
            response = await complete(client)
        assert response.choices[0].text == "ok"
    async with client_for(app, api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await complete(client)
    assert KEY not in caplog.text
    assert KEY not in repr(Guard(api_keys=[KEY]))


def test_an_empty_key_is_refused_at_configuration() -> None:
    with pytest.raises(ValueError, match="empty"):
        Guard(api_keys=[" "])


# ---------------------------------------------------------------------- admission


async def test_beyond_max_inflight_a_request_gets_503_with_retry_after() -> None:
    engine = ScriptedEngine(outputs("a b"), then="hang")
    app = make_app(engine, max_inflight=1)
    async with client_for(app) as client:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect_stream, client)
                await engine.hanging.wait()
                with pytest.raises(openai.APIStatusError) as caught:
                    await complete(client)
                (ctx,) = engine.requests
                ctx.stop_generating()  # let the first one finish
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "1"
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["type"] == "service_unavailable_error"
    metrics = app.metrics.render().decode()
    assert 'llm_pipeline_rejected_requests_total{reason="max_inflight"} 1.0' in metrics
    assert app.inflight == 0


# ---------------------------------------------------------------------- deadlines


async def test_a_request_past_its_deadline_gets_a_504_and_is_killed() -> None:
    engine = ScriptedEngine(outputs("a"), then="hang")
    app = make_app(engine, request_timeout=0.2)
    async with client_for(app) as client:
        with anyio.fail_after(10), pytest.raises(openai.APIStatusError) as caught:
            await complete(client)
    assert caught.value.status_code == 504
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["type"] == "timeout_error"
    assert body["code"] == "request_timeout"
    (ctx,) = engine.requests
    assert ctx.is_killed
    assert engine.open_streams == 0
    assert app.inflight == 0
    assert "llm_pipeline_timed_out_requests_total 1.0" in app.metrics.render().decode()


async def test_a_stream_past_its_deadline_ends_with_a_timeout_event() -> None:
    engine = ScriptedEngine(outputs("a b"), then="hang")
    app = make_app(engine, request_timeout=0.2)
    async with client_for(app) as client:
        stream = await client.completions.create(model="m", prompt="x", stream=True)
        texts: list[str] = []
        with anyio.fail_after(10), pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
    assert "".join(texts) == "a b"  # what was produced arrived first
    assert "timeout" in caught.value.message
    assert engine.open_streams == 0
    assert app.inflight == 0


async def test_the_client_timeout_header_shortens_a_non_streamed_deadline() -> None:
    engine = ScriptedEngine(outputs("a"), then="hang")
    app = make_app(engine)  # no server limit: the client's own timeout applies
    async with client_for(app, timeout=0.3) as client:
        with anyio.fail_after(10), pytest.raises(openai.APIError) as caught:
            await complete(client)
    # the server answered first with its timeout error, or the client gave up at the same
    # moment; either way nothing is left running
    assert isinstance(caught.value, openai.APIStatusError | openai.APITimeoutError)
    assert app.inflight == 0
    assert engine.open_streams == 0


def test_the_timeout_header_is_ignored_for_streams_and_when_malformed() -> None:
    guard = Guard(request_timeout=5.0)
    scope = {"headers": [(b"x-stainless-read-timeout", b"2")]}
    assert guard.timeout_for(scope, stream=False) == 2.0
    assert guard.timeout_for(scope, stream=True) == 5.0
    nan = {"headers": [(b"x-stainless-read-timeout", b"nan")]}
    negative = {"headers": [(b"x-stainless-read-timeout", b"-1")]}
    assert guard.timeout_for(nan, stream=False) == 5.0
    assert Guard().timeout_for(negative, stream=False) is None
    assert Guard().timeout_for(scope, stream=False) == 2.0


# ------------------------------------------------------------------- end of a drain


async def test_abort_ends_streams_with_an_error_and_requests_with_503() -> None:
    both_hang = anyio.Event()
    hanging = 0
    open_streams = 0

    async def hang_after_two_tokens(ctx: Context[Any]) -> AsyncIterator[EngineOutput]:
        nonlocal hanging, open_streams
        open_streams += 1
        try:
            for output in outputs("a b"):
                yield output
            hanging += 1
            if hanging == 2:
                both_hang.set()
            await ctx.wait_stopped()
        finally:
            open_streams -= 1

    graph = default_graph(FunctionEngine(hang_after_two_tokens), TOKENIZER, model_name="m")
    app = OpenAIApp(graph, model_name="m")
    results: dict[str, BaseException] = {}

    async def run(name: str, stream: bool) -> None:
        async with client_for(app) as client:
            try:
                if stream:
                    await collect_stream(client)
                else:
                    await complete(client)
            except openai.APIError as exc:
                results[name] = exc

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "stream", True)
            tg.start_soon(run, "complete", False)
            await both_hang.wait()
            app.drain()
            app.abort()
    assert isinstance(results["complete"], openai.APIStatusError)
    assert results["complete"].status_code == 503
    assert "shut down" in results["stream"].message
    assert app.inflight == 0
    assert open_streams == 0


# ---------------------------------------------------------------------- the CLI


@pytest.mark.slow
def test_serve_takes_keys_from_the_flag_and_the_environment() -> None:
    os.environ["LLM_PIPELINE_API_KEY"] = "from-env"
    try:
        server = ServerProcess("--api-key", KEY, "--max-inflight", "4", "--request-timeout", "30")
    finally:
        del os.environ["LLM_PIPELINE_API_KEY"]
    try:
        for key in (KEY, "from-env"):
            client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
            response = client.completions.create(model=server.model, prompt="hi", max_tokens=2)
            assert response.choices[0].text == "hi"
        bad = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200
        assert KEY not in server.stderr()
    finally:
        server.stop()
