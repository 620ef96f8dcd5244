"""/live, /ready and /health tell the truth, in-process, with the official client: an engine
that freezes ends its streams with a 503 and refuses new requests at once; one that dies is
rebuilt and answers as before; a drain is not ready but alive; a busy port is one error."""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.contracts.probe import one_token_probe
from operators.edges.http.runner import CannotListen
from operators.serving import build_app, serve
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, EngineDead
from pipeline.health import Supervised

TOKENIZER = Tokenizer.default()
WORDS = TOKENIZER.encode(" one two three four five six seven eight")


class Words:
    """Says WORDS a token at a time. ``freeze_after`` tokens in all, every stream waits
    (an engine stopped with SIGSTOP) until ``thaw()``; ``die()`` makes the waiting ones
    raise EngineDead (its process killed)."""

    features = frozenset[str]()

    def __init__(self, *, freeze_after: int | None = None) -> None:
        self.freeze_after = freeze_after
        self.said = 0
        self.thawed = anyio.Event()
        self.dead: str | None = None
        self._died = anyio.Event()

    def thaw(self) -> None:
        self.freeze_after = None
        self.thawed.set()

    def die(self) -> None:
        self.dead = "its process was killed"
        self._died.set()

    async def _frozen(self) -> None:
        async with anyio.create_task_group() as tg:

            async def died() -> None:
                await self._died.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(died)
            await self.thawed.wait()
            tg.cancel_scope.cancel()

    async def generate(self, ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        budget = min(ctx.data.stop.max_tokens or len(WORDS), len(WORDS))
        for i in range(budget):
            if self.freeze_after is not None and self.said >= self.freeze_after:
                await self._frozen()
            if self.dead is not None:
                raise EngineDead(self.dead, request_id=ctx.id)
            self.said += 1
            yield EngineOutput([WORDS[i]], finish_reason="length" if i == budget - 1 else None)


def http_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


async def probes(http: httpx.AsyncClient) -> dict[str, tuple[int, Any]]:
    found = {}
    for path in ("/live", "/ready", "/health"):
        response = await http.get(path)
        found[path] = (response.status_code, response.json())
    return found


async def until_ready(http: httpx.AsyncClient, within: float = 5.0) -> None:
    """Poll /ready (what an orchestrator does) until it says 200."""
    with anyio.fail_after(within):
        while (await http.get("/ready")).status_code != 200:  # noqa: ASYNC110 - a probe
            await anyio.sleep(0.05)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match[1])


async def test_a_fresh_app_is_live_ready_and_healthy() -> None:
    app = build_app(Words(), TOKENIZER, model_name="w")
    async with http_for(app) as http:
        assert await probes(http) == {
            "/live": (200, {"status": "live"}),
            "/ready": (200, {"status": "ready", "models": {"w": {"ready": True}}}),
            "/health": (200, {"status": "ok"}),
        }
        assert (await http.post("/ready")).status_code == 405
        assert (
            metric((await http.get("/metrics")).text, 'llm_pipeline_engine_ready{model="w"}') == 1
        )


async def test_a_draining_app_is_alive_but_not_ready() -> None:
    app = build_app(Words(), TOKENIZER, model_name="w")
    app.drain()
    async with http_for(app) as http:
        found = await probes(http)
    assert found["/live"] == (200, {"status": "live"})
    assert found["/ready"] == (
        503,
        {"status": "not_ready", "reason": "draining", "models": {"w": {"ready": True}}},
    )
    assert found["/health"] == (503, {"status": "draining"})


async def test_a_frozen_engine_ends_its_stream_with_a_503_and_refuses_new_requests_at_once() -> (
    None
):
    engine = Words(freeze_after=2)
    app = build_app(engine, TOKENIZER, model_name="w", stall_timeout=0.3)
    async with (
        anyio.create_task_group() as tg,
        openai_client(app) as client,
        http_for(app) as http,
    ):
        await tg.start(app.health.run)
        texts: list[str] = []
        with pytest.raises(openai.APIError) as failed:
            stream = await client.completions.create(
                model="w", prompt="x", max_tokens=6, stream=True
            )
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert "".join(texts) == TOKENIZER.decode(WORDS[:2])
        assert failed.value.code == "engine_unavailable"
        assert "engine stalled: no output for" in failed.value.message
        found = await probes(http)
        assert found["/live"] == (200, {"status": "live"})
        status, body = found["/ready"]
        assert status == 503
        assert body["status"] == "not_ready"
        assert not body["models"]["w"]["ready"]
        assert "engine stalled: no output for" in body["models"]["w"]["reason"]
        assert found["/health"][0] == 503
        with anyio.fail_after(1):  # at once, not after another stall
            with pytest.raises(openai.InternalServerError) as refused:
                await client.completions.create(model="w", prompt="x", max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "5"
        assert refused.value.code == "engine_unavailable"
        scraped = (await http.get("/metrics")).text
        assert metric(scraped, 'llm_pipeline_engine_ready{model="w"}') == 0
        assert metric(scraped, 'llm_pipeline_engine_stalls_total{model="w"}') == 1
        assert metric(scraped, 'llm_pipeline_rejected_requests_total{reason="engine_unavailable"}')
        engine.thaw()  # (SIGCONT): its probe is answered
        await until_ready(http)
        reply = await client.completions.create(model="w", prompt="x", max_tokens=3)
        assert reply.choices[0].text == TOKENIZER.decode(WORDS[:3])
        tg.cancel_scope.cancel()


async def test_a_dead_engine_is_rebuilt_by_its_factory_and_answers_as_before() -> None:
    first = Words()
    built: list[Words] = []

    async def factory() -> Words:
        built.append(Words())
        return built[-1]

    engine = Supervised(first, factory=factory, probe=one_token_probe, name="w-0")
    app = build_app(engine, TOKENIZER, model_name="w")
    async with (
        anyio.create_task_group() as tg,
        openai_client(app) as client,
        http_for(app) as http,
    ):
        await tg.start(app.health.run)
        before = await client.completions.create(model="w", prompt="x", max_tokens=5)
        first.freeze_after = first.said + 2
        failures: list[openai.APIError] = []

        async def stream_it() -> None:
            try:
                stream = await client.completions.create(
                    model="w", prompt="x", max_tokens=5, stream=True
                )
                async for _ in stream:
                    pass
            except openai.APIError as exc:
                failures.append(exc)

        async with anyio.create_task_group() as streaming:
            streaming.start_soon(stream_it)
            while engine.waiting == 0 or first.said < 7:  # noqa: ASYNC110 - frozen mid-stream
                await anyio.sleep(0.01)
            first.die()
        [failed] = failures
        assert failed.code == "engine_unavailable"  # (the one engine: no migration)
        await until_ready(http)
        after = await client.completions.create(model="w", prompt="x", max_tokens=5)
        assert after.choices[0].text == before.choices[0].text
        assert len(built) == 1
        assert engine.engine is built[0]
        scraped = (await http.get("/metrics")).text
        assert metric(scraped, 'llm_pipeline_engine_restarts_total{model="w"}') == 1
        assert (await http.get("/live")).status_code == 200
        tg.cancel_scope.cancel()


async def test_serving_on_a_busy_port_is_one_error_naming_it() -> None:
    app = build_app(Words(), TOKENIZER, model_name="w")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(CannotListen) as failed:
            await serve(app, host="127.0.0.1", port=port, handle_signals=False)
    assert failed.value.errno == errno.EADDRINUSE
    assert (
        str(failed.value.strerror) == f"cannot listen on 127.0.0.1:{port}: Address already in use"
    )
