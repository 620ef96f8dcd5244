"""Serving from Python: build_app wires the graph, the name and the metrics; serve stops
when cancelled; openai_client talks to an app without a socket."""

from __future__ import annotations

import gc

import anyio
import httpx

from operators.engines import EchoEngine
from operators.serving import build_app, serve
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()


async def test_build_app_serves_the_engine_under_one_name() -> None:
    app = build_app(EchoEngine.from_tokenizer(TOKENIZER), TOKENIZER, model_name="echo")
    assert app.model_name == "echo"
    async with openai_client(app) as client:
        reply = await client.completions.create(model="echo", prompt="hi there", max_tokens=5)
        models = await client.models.list()
    assert reply.choices[0].text == "hi there"
    assert reply.model == "echo"
    assert [model.id for model in models.data] == ["echo"]


async def test_build_app_counts_migrations_in_its_metrics() -> None:
    engine = EchoEngine.from_tokenizer(TOKENIZER, fail_after_tokens=2)
    app = build_app(engine, TOKENIZER, model_name="echo")
    async with openai_client(app) as client:
        reply = await client.completions.create(model="echo", prompt="one two three four")
    assert reply.choices[0].text == "one two three four"  # resumed after the fault
    metrics = app.metrics.render().decode()
    assert 'llm_pipeline_migrations_total{kind="stream",outcome="retried"} 1.0' in metrics


async def test_serve_runs_until_its_task_is_cancelled() -> None:
    app = build_app(EchoEngine.from_tokenizer(TOKENIZER), TOKENIZER, model_name="echo")
    listening = anyio.Event()
    ports: list[int] = []

    def ready(host: str, port: int) -> None:
        ports.append(port)
        listening.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve(app, port=0, on_ready=ready, handle_signals=False))
            await listening.wait()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}") as http:
                response = await http.post(
                    "/v1/completions", json={"prompt": "ok", "max_tokens": 1}
                )
            assert response.json()["choices"][0]["text"] == "ok"
            tg.cancel_scope.cancel()
    assert app.inflight == 0
    gc.collect()  # a listening socket left open would be an unraisable ResourceWarning here
