"""One app, several models: ``build_app`` with a graph per model, every edge routing by the
request's ``model`` (in-process, through the official clients).

Each echo model renders its prompt with its own chat template, so the echo says which
graph answered.
"""

from __future__ import annotations

import re
from typing import Any

import anthropic
import httpx
import openai
import pytest

from operators.edges.http.models import Models, ServedModel
from operators.engines import EchoEngine
from operators.serving import ModelSpec, build_app, build_model
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()
A = "A:{% for m in messages %}{{ m.content }}{% endfor %}"
B = "B:{% for m in messages %}{{ m.content }}{% endfor %}"
HI: Any = [{"role": "user", "content": "hi"}]


def echo() -> EchoEngine:
    return EchoEngine.from_tokenizer(TOKENIZER)


def two_models(**options: Any) -> Any:
    return build_app(
        {
            "alpha": ModelSpec(engine=echo(), tokenizer=TOKENIZER, options={"chat_template": A}),
            "beta": ModelSpec(engine=echo(), tokenizer=TOKENIZER, options={"chat_template": B}),
        },
        **options,
    )


async def test_each_request_reaches_its_own_models_graph() -> None:
    app = two_models()
    async with openai_client(app) as api:
        alpha = await api.chat.completions.create(model="alpha", messages=HI)
        beta = await api.chat.completions.create(model="beta", messages=HI)
        streamed = await api.chat.completions.create(model="beta", messages=HI, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
        unnamed = await api.completions.create(model="alpha", prompt="plain")
    assert (alpha.model, alpha.choices[0].message.content) == ("alpha", "A:hi")
    assert (beta.model, beta.choices[0].message.content) == ("beta", "B:hi")
    assert text == "B:hi"
    assert unnamed.choices[0].text == "plain"


async def test_models_lists_every_model_and_one_model_is_found_by_name() -> None:
    app = two_models()
    async with openai_client(app) as api:
        listed = await api.models.list()
        one = await api.models.retrieve("beta")
        with pytest.raises(openai.NotFoundError) as missing:
            await api.models.retrieve("gamma")
    assert [model.id for model in listed.data] == ["alpha", "beta"]
    assert [getattr(model, "parent", "?") for model in listed.data] == [None, None]
    assert one.id == "beta"
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_an_unknown_model_is_a_404_naming_model_on_every_edge() -> None:
    app = two_models()
    async with openai_client(app) as api:
        calls = [
            api.chat.completions.create(model="gamma", messages=HI),
            api.completions.create(model="gamma", prompt="x"),
            api.responses.create(model="gamma", input="x"),
            api.embeddings.create(model="gamma", input="x"),
        ]
        for call in calls:
            with pytest.raises(openai.NotFoundError) as refused:
                await call
            body: Any = refused.value.body
            assert (body["param"], body["code"]) == ("model", "model_not_found")
            assert "'alpha', 'beta'" in body["message"]
        for path in ("/tokenize", "/detokenize"):
            raw = await api._client.post(f"http://app{path}", json={"model": "gamma", "tokens": []})
            assert raw.status_code == 404
            assert raw.json()["error"]["param"] == "model"
    async with anthropic_client(app) as claude:
        with pytest.raises(anthropic.NotFoundError) as refused:
            await claude.messages.create(model="gamma", max_tokens=5, messages=HI)
        assert refused.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        with pytest.raises(anthropic.NotFoundError):
            await claude.messages.count_tokens(model="gamma", messages=HI)


async def test_messages_responses_and_tokenize_route_by_model_too() -> None:
    app = two_models()
    async with anthropic_client(app) as claude:
        message = await claude.messages.create(model="beta", max_tokens=20, messages=HI)
        counted = await claude.messages.count_tokens(model="beta", messages=HI)
    async with openai_client(app) as api:
        response = await api.responses.create(model="alpha", input="hi")
        tokens = await api._client.post(
            "http://app/tokenize", json={"model": "beta", "messages": HI}
        )
    assert message.content[0].text == "B:hi"  # type: ignore[union-attr]
    assert counted.input_tokens == message.usage.input_tokens
    assert response.output_text == "A:hi"
    assert response.model == "alpha"
    assert TOKENIZER.decode(tokens.json()["tokens"], skip_special_tokens=False) == "B:hi"


async def test_a_request_naming_no_model_runs_on_the_first() -> None:
    app = two_models()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
        reply = await http.post("/v1/chat/completions", json={"messages": HI})
    assert reply.json()["choices"][0]["message"]["content"] == "A:hi"
    assert reply.json()["model"] == "alpha"


async def test_per_request_metrics_carry_the_model() -> None:
    app = two_models()
    async with openai_client(app) as api:
        await api.chat.completions.create(model="alpha", messages=HI)
        stream = await api.chat.completions.create(model="beta", messages=HI, stream=True)
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await api.chat.completions.create(model="gamma", messages=HI)
    metrics = app.metrics.render().decode()

    def sample(line: str) -> float:
        found = re.search(rf"^{re.escape(line)} (\S+)$", metrics, re.MULTILINE)
        assert found is not None, line
        return float(found[1])

    requests = (
        'llm_pipeline_requests_total{{endpoint="/v1/chat/completions",model="{}",status="{}"}}'
    )
    assert sample(requests.format("alpha", 200)) == 1
    assert sample(requests.format("beta", 200)) == 1
    assert sample(requests.format("", 404)) == 1  # an unknown name is never a label
    assert "gamma" not in metrics
    assert sample('llm_pipeline_output_tokens_total{model="alpha"}') > 0
    assert sample('llm_pipeline_output_tokens_total{model="beta"}') > 0
    assert sample('llm_pipeline_time_to_first_token_seconds_count{model="beta"}') == 1
    assert sample('llm_pipeline_request_duration_seconds_count{model="alpha"}') == 1


async def test_models_added_and_removed_while_serving_are_followed() -> None:
    app = build_app(models={})
    transport = httpx.ASGITransport(app=app)
    async with (
        openai_client(app) as api,
        httpx.AsyncClient(transport=transport, base_url="http://app") as http,
    ):
        assert (await api.models.list()).data == []
        nothing = await http.post("/v1/chat/completions", json={"messages": HI})
        assert nothing.status_code == 503  # no model yet: later, not never
        app.models.add(build_model("late", echo(), TOKENIZER, chat_template=A))
        late = await api.chat.completions.create(model="late", messages=HI)
        assert late.choices[0].message.content == "A:hi"
        assert [model.id for model in (await api.models.list()).data] == ["late"]
        assert app.models.remove("late") is not None
        with pytest.raises(openai.NotFoundError):
            await api.chat.completions.create(model="late", messages=HI)


def test_models_resolve_names_and_refuse_the_rest() -> None:
    graph: Any = object()
    models = Models(
        [ServedModel(name="a", graph=graph), ServedModel(name="b", graph=graph, parent="a")]
    )
    assert models.resolve(None).name == "a"
    assert models.resolve("b").parent == "a"
    assert [m.name for m in models.adapters_of("a")] == ["b"]
    assert models.get("c") is None
    card = models.resolve("b").card()
    assert (card["id"], card["parent"], card["object"]) == ("b", "a", "model")


def test_build_app_needs_an_engine_or_models() -> None:
    with pytest.raises(TypeError):
        build_app()
    with pytest.raises(TypeError):
        build_app(echo(), TOKENIZER)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="'bad'"):
        build_app({"bad": echo()})  # type: ignore[dict-item]
    app = build_app({"x": (echo(), TOKENIZER)})
    assert app.models.names == ("x",)
