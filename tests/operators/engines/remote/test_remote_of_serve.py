"""Any of our servers is an upstream of another: ``serve --engine remote --upstream`` in front
of ``serve --engine mocker``, both real processes, over the tokens-in/tokens-out route.

The front detects the upstream as a vLLM-kind server (its models say ``llm-pipeline``; it
serves ``/inference/v1/generate``), or is told so (``--upstream-kind vllm``); a chat through
the front equals the upstream's own answer; the remote engine keeps the engine contract
over the upstream (stop, kill, continuation, errors); the front's status page lists it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from operators.engines.remote import RemoteEngine, parse_upstream
from operators.testing import check_engine
from operators.text.tokenizer import Tokenizer
from tests.helpers.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.time_limit(60)]

TOKENIZER = Tokenizer.default()
CHAT = [{"role": "user", "content": "Tell me about routers, tokens in and tokens out."}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[ServerProcess]:
    server = ServerProcess("--engine", "mocker", "--model-name", "up", "--max-model-len", "4096")
    yield server
    server.stop()


async def chat(server: ServerProcess, model: str) -> str:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as api:
        answer = await api.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
    return answer.choices[0].message.content or ""


@pytest.mark.parametrize("kind", [None, "vllm"])
async def test_a_chat_through_a_front_equals_the_upstreams_own(
    upstream: ServerProcess, kind: str | None
) -> None:
    told = [] if kind is None else ["--upstream-kind", kind]
    front = ServerProcess("--engine", "remote", "--upstream", upstream.url, *told)
    try:
        assert front.model == "up"  # the upstream's own name
        assert await chat(front, "up") == await chat(upstream, "up")
        async with httpx.AsyncClient(timeout=5) as http:
            status = (await http.get(f"{front.url}/status")).json()
        [row] = status["workers"]
        assert row["where"] == f"vllm at {upstream.url}"
        assert row["routed"] == 1
    finally:
        front.stop()
    assert "Traceback" not in front.stderr()


async def test_the_remote_engine_keeps_the_engine_contract_over_our_serve(
    upstream: ServerProcess,
) -> None:
    probe = await RemoteEngine.connect(parse_upstream(upstream.url), tokenizer=TOKENIZER)
    info = probe.info
    await probe.aclose()
    engines: list[RemoteEngine] = []

    def factory() -> RemoteEngine:
        engine = RemoteEngine(parse_upstream(upstream.url), info, tokenizer=TOKENIZER)
        engines.append(engine)
        return engine

    assert (info.kind, info.generate, info.max_model_len) == ("vllm", True, 4096)
    try:
        # (not ``deterministic``: the mocker's tokens depend on where its prompt ends, which a
        # tokens-in request does not say; a model's continuation of prompt + output does not)
        await check_engine(
            factory, prompt=TOKENIZER.encode("Once upon a time"), deterministic=False
        )
    finally:
        for engine in engines:
            await engine.aclose()
