"""Keys with terms, as the official clients see them (in-process, a frozen clock for the
limits): 429s in each API's shape and headers, reservations settled to the real count, a
model a key may not use indistinguishable from one not served, per-key usage, a key's
requests in flight, and the fair queue's order."""

from __future__ import annotations

import datetime
import math
import re
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from operators.edges.http.budgets import LocalBudgets
from operators.edges.http.guard import Guard
from operators.edges.http.tenants import parse_tenants
from operators.engines import EchoEngine
from operators.serving import ModelSpec, build_app
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Stream

TOKENIZER = Tokenizer.default()
HI: Any = [{"role": "user", "content": "hi"}]


class Clock:
    """A wall clock that moves only when told (the limits' refill)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class EchoThatEmbeds:
    """The echo engine, with an ``embed`` (each input: its length)."""

    def __init__(self) -> None:
        self._echo = EchoEngine.from_tokenizer(TOKENIZER)
        self.prompts: list[list[int]] = []

    def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        self.prompts.append(list(ctx.data.token_ids))
        return self._echo.generate(ctx)

    async def embed(self, token_ids: Sequence[Sequence[int]], /) -> list[list[float]]:
        return [[float(len(tokens))] for tokens in token_ids]


def app_with(keys: str, clock: Clock | None = None, engine: Any = None, **guard: Any) -> Any:
    tenants = parse_tenants(textwrap.dedent(keys))
    budgets = LocalBudgets(clock or Clock())
    protections = Guard(tenants=tenants, budgets=budgets, **guard)
    return build_app(
        EchoThatEmbeds() if engine is None else engine,
        TOKENIZER,
        model_name="echo",
        guard=protections,
        max_model_len=2048,
    )


def rate_headers(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if "ratelimit" in k or k.startswith("retry-after")}


async def test_requests_per_minute_run_out_with_openais_429_and_headers() -> None:
    app = app_with('[[key]]\nname = "a"\nkey = "sk-a"\nrequests_per_minute = 2\n')
    async with openai_client(app, api_key="sk-a") as api:
        first = await api.chat.completions.with_raw_response.create(model="echo", messages=HI)
        second = await api.completions.with_raw_response.create(model="echo", prompt="x")
        with pytest.raises(openai.RateLimitError) as refused:
            await api.responses.create(model="echo", input="x")
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "30s"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    error = refused.value
    assert error.status_code == 429
    assert error.body == {
        "message": "Rate limit reached for key 'a' on requests per min (RPM): Limit 2, "
        "Used 2, Requested 1. Please try again in 30s.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert rate_headers(error.response.headers) == {
        "retry-after": "30",
        "retry-after-ms": "30000",
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
    }


async def test_tokens_per_minute_run_out_with_anthropics_429_and_headers() -> None:
    app = app_with('[[key]]\nname = "b"\nkey = "sk-b"\ntokens_per_minute = 600\n')
    before = math.floor(time.time())
    async with anthropic_client(app, api_key="sk-b") as claude:
        done = await claude.messages.with_raw_response.create(
            model="echo", max_tokens=500, messages=HI
        )
        with pytest.raises(anthropic.RateLimitError) as refused:  # 560 > 600 - what it used
            await claude.messages.create(model="echo", max_tokens=560, messages=HI)
    message = await done.parse()
    used = message.usage.input_tokens + message.usage.output_tokens
    # the answer's headers: its reservation (prompt + max_tokens) held, not yet settled
    prompt = message.usage.input_tokens
    assert done.headers["anthropic-ratelimit-tokens-remaining"] == str(600 - prompt - 500)
    error = refused.value
    assert error.status_code == 429
    body: Any = error.body
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    said = re.fullmatch(
        r"Rate limit reached for key 'b' on tokens per min \(TPM\): Limit 600, Used (\d+), "
        r"Requested (\d+)\. Please try again in ([\d.]+)s\.",
        body["error"]["message"],
    )
    assert said is not None, body
    # held at arrival: max_tokens and the body's bytes standing for its prompt
    asked = int(said[2])
    assert int(said[1]) == used
    assert 560 < asked < 600
    headers = error.response.headers
    wait = (used + asked - 600) / 10  # tokens over the limit, at 10 a second
    assert float(said[3]) == pytest.approx(wait, rel=1e-2)
    assert headers["retry-after-ms"] == str(round(wait * 1000))
    assert headers["anthropic-ratelimit-tokens-limit"] == "600"
    assert headers["anthropic-ratelimit-tokens-remaining"] == str(600 - used)
    reset = datetime.datetime.fromisoformat(headers["anthropic-ratelimit-tokens-reset"])
    full = used / 10  # seconds until the bucket is full, told as a moment (RFC 3339)
    assert before + full <= reset.timestamp() + 1e-6 <= time.time() + full + 1
    assert "anthropic-ratelimit-requests-limit" not in headers  # (no such limit)


async def test_unused_reserved_tokens_go_back_to_the_next_request() -> None:
    """A request that stops early (the echo of a short prompt, with max_tokens 900)
    settles to what it used: the next one's 900 fit, which they could not if the first
    kept its reservation."""
    app = app_with('[[key]]\nname = "a"\nkey = "sk-a"\ntokens_per_minute = 1000\n')
    async with openai_client(app, api_key="sk-a") as api:
        first = await api.chat.completions.with_raw_response.create(
            model="echo", messages=HI, max_tokens=900
        )
        second = await api.chat.completions.with_raw_response.create(
            model="echo", messages=HI, max_tokens=900
        )
    usage = first.parse().usage
    assert usage is not None
    assert usage.completion_tokens < 900
    used = usage.total_tokens
    held = usage.prompt_tokens + 900
    assert first.headers["x-ratelimit-remaining-tokens"] == str(1000 - held)
    assert second.headers["x-ratelimit-remaining-tokens"] == str(1000 - used - held)


async def test_a_request_larger_than_the_minute_is_refused_before_the_engine_runs() -> None:
    engine = EchoThatEmbeds()
    app = app_with('[[key]]\nname = "a"\nkey = "sk-a"\ntokens_per_minute = 100\n', engine=engine)
    async with openai_client(app, api_key="sk-a", max_retries=3) as api:
        with pytest.raises(openai.RateLimitError) as refused:  # (the SDK does not retry)
            await api.chat.completions.create(model="echo", messages=HI, max_tokens=90)
        with pytest.raises(openai.RateLimitError) as streamed:
            await api.chat.completions.create(model="echo", messages=HI, max_tokens=90, stream=True)
    for error in (refused.value, streamed.value):
        assert error.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in error.response.headers
        assert error.body["type"] == "tokens"  # type: ignore[index]
        assert error.body["message"].startswith("Request too large for key 'a'")  # type: ignore[index]
    assert engine.prompts == []  # refused at its prompt: the engine never saw it
    metrics = (
        await httpx.AsyncClient(transport=httpx.ASGITransport(app)).get("http://t/metrics")
    ).text
    assert 'llm_pipeline_key_requests_total{key="a",model="echo",status="429"} 2.0' in metrics


async def test_a_model_a_key_may_not_use_is_a_404_like_one_not_served() -> None:
    tenants = parse_tenants('[[key]]\nname = "a"\nkey = "sk-a"\nmodels = ["al*"]\n')
    app = build_app(
        {
            "alpha": ModelSpec(engine=EchoThatEmbeds(), tokenizer=TOKENIZER),
            "beta": ModelSpec(engine=EchoThatEmbeds(), tokenizer=TOKENIZER),
        },
        guard=Guard(tenants=tenants),
    )
    errors: dict[str, list[Any]] = {"beta": [], "nope": []}
    async with openai_client(app, api_key="sk-a") as api:
        listed = await api.models.list()
        for name in errors:
            for call in (
                api.chat.completions.create(model=name, messages=HI),
                api.responses.create(model=name, input="x"),
                api.embeddings.create(model=name, input="x"),
                api.models.retrieve(name),
            ):
                with pytest.raises(openai.NotFoundError) as refused:
                    await call
                errors[name].append(refused.value.body)
        default = await api.chat.completions.create(model="alpha", messages=HI)
    async with anthropic_client(app, api_key="sk-a") as claude:
        for name in errors:
            with pytest.raises(anthropic.NotFoundError) as missing:
                await claude.messages.create(model=name, max_tokens=5, messages=HI)
            errors[name].append(missing.value.body)
    assert [model.id for model in listed.data] == ["alpha"]
    assert default.model == "alpha"
    for beta, nope in zip(errors["beta"], errors["nope"], strict=True):
        assert str(beta).replace("beta", "X") == str(nope).replace("nope", "X")
        assert "beta" not in str(nope)


async def test_usage_is_counted_per_key_and_model_as_the_responses_said() -> None:
    app = app_with(
        """
        [[key]]
        name = "a"
        key = "sk-a"
        [[key]]
        name = "b"
        key = "sk-b"
        [[key]]
        name = "root"
        key = "sk-root"
        admin = true
        """
    )
    async with openai_client(app, api_key="sk-a") as api:
        chat = await api.chat.completions.create(model="echo", messages=HI)
        response = await api.responses.create(model="echo", input="hello there")
        streamed = await api.chat.completions.create(
            model="echo", messages=HI, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in streamed]
        embedded = await api.embeddings.create(model="echo", input="one two three")
    async with anthropic_client(app, api_key="sk-b") as claude:
        message = await claude.messages.create(model="echo", max_tokens=50, messages=HI)
    last = chunks[-1].usage
    assert chat.usage is not None
    assert last is not None
    assert response.usage is not None
    prompt_a = (
        chat.usage.prompt_tokens
        + response.usage.input_tokens
        + last.prompt_tokens
        + embedded.usage.prompt_tokens
    )
    output_a = chat.usage.completion_tokens + response.usage.output_tokens + last.completion_tokens
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
    own = (await http.get("/v1/usage", headers={"authorization": "Bearer sk-a"})).json()
    every = (await http.get("/v1/usage", headers={"authorization": "Bearer sk-root"})).json()
    metrics = (await http.get("/metrics")).text
    assert own["object"] == "usage"
    assert own["data"] == [
        {
            "key": "a",
            "model": "echo",
            "requests": 4,
            "statuses": {"200": 4},
            "prompt_tokens": prompt_a,
            "cached_tokens": 0,
            "output_tokens": output_a,
            "total_tokens": prompt_a + output_a,
        }
    ]
    b = message.usage
    assert [(row["key"], row["prompt_tokens"], row["output_tokens"]) for row in every["data"]] == [
        ("a", prompt_a, output_a),
        ("b", b.input_tokens, b.output_tokens),
    ]
    assert f'llm_pipeline_key_tokens_total{{key="a",kind="prompt",model="echo"}} {prompt_a}.0' in (
        metrics
    )
    assert (
        f'llm_pipeline_key_tokens_total{{key="b",kind="output",model="echo"}} {b.output_tokens}.0'
        in (metrics)
    )
    assert 'llm_pipeline_key_requests_total{key="a",model="echo",status="200"} 4.0' in metrics


@pytest.mark.parametrize(
    ("query", "status", "param"),
    [
        ("since=yesterday", 400, "since"),
        ("since=nan", 400, "since"),
        ("since=inf", 400, "since"),
        ("since=-5", 400, "since"),
        ("since=1e300", 400, "since"),
        ("since=2026-01-02T03:04:05", 400, "since"),  # no time zone
        ("since=" + "9" * 5000, 400, "since"),
        ("since=1&since=2", 400, "since"),
        ("when=1", 400, "when"),
        ("key=root", 403, "key"),
        ("key=nobody", 403, "key"),  # the same whether the key exists or not
    ],
)
async def test_usage_refuses_a_bad_query_naming_it(query: str, status: int, param: str) -> None:
    app = app_with(
        '[[key]]\nname = "a"\nkey = "sk-a"\n[[key]]\nname = "root"\nkey = "sk-r"\nadmin = true\n'
    )
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
    answer = await http.get(f"/v1/usage?{query}", headers={"authorization": "Bearer sk-a"})
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["param"] == param
    assert "sk-" not in answer.text


async def test_usage_since_counts_from_then_and_says_so() -> None:
    app = app_with('[[key]]\nname = "a"\nkey = "sk-a"\nadmin = true\n')
    async with openai_client(app, api_key="sk-a") as api:
        await api.chat.completions.create(model="echo", messages=HI)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
    auth = {"authorization": "Bearer sk-a"}
    future = (await http.get("/v1/usage?since=4102444800", headers=auth)).json()
    ancient = (await http.get("/v1/usage?since=1970-01-01T00:00:00Z", headers=auth)).json()
    assert future["since"] == "2100-01-01T00:00:00Z"
    assert future["data"] == []
    assert ancient["data"][0]["requests"] == 1
    assert ancient["since"] > "1970"  # clamped to what is kept (a day)
    missing = await http.get("/v1/usage")
    assert missing.status_code == 401


class Gate:
    """An engine whose requests wait, each recording its prompt's first word, until
    released one at a time."""

    def __init__(self) -> None:
        self._echo = EchoEngine.from_tokenizer(TOKENIZER)
        self.started: list[str] = []
        self.entered = anyio.Event()
        self._release = anyio.Semaphore(0)

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            self._release.release()

    async def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        self.started.append(TOKENIZER.decode(ctx.data.token_ids).split()[0])
        self.entered.set()
        await self._release.acquire()
        async for output in self._echo.generate(ctx):
            yield output


async def waiting(app: Any, count: int) -> None:
    """Until ``count`` requests wait for a slot."""
    admission = app.generations.admission
    while admission.waiting != count:
        await admission.changed().wait()


async def test_a_key_at_its_max_inflight_is_refused_until_one_ends() -> None:
    gate = Gate()
    app = app_with('[[key]]\nname = "a"\nkey = "sk-a"\nmax_inflight = 1\n', engine=gate)
    async with openai_client(app, api_key="sk-a") as api, anyio.create_task_group() as tg:
        tg.start_soon(lambda: api.completions.create(model="echo", prompt="first", max_tokens=2))
        await gate.entered.wait()
        with pytest.raises(openai.RateLimitError) as refused:
            await api.completions.create(model="echo", prompt="second", max_tokens=2)
        gate.release()
    assert refused.value.body["message"].startswith("Too many requests in flight")  # type: ignore[index]
    assert refused.value.response.headers["retry-after"] == "1"
    async with openai_client(app, api_key="sk-a") as api:
        gate.release()
        third = await api.completions.create(model="echo", prompt="third", max_tokens=2)
    assert third.choices[0].text


@pytest.mark.time_limit(30)
async def test_a_flooding_key_does_not_starve_another_of_the_same_priority() -> None:
    """Key A sends 64, key B then 4, with 8 slots: B's requests are admitted within its
    fair share of the slots freed after they arrived (every other one), not after A's
    56 waiting ones."""
    gate = Gate()
    app = app_with(
        '[[key]]\nname = "a"\nkey = "sk-a"\n[[key]]\nname = "b"\nkey = "sk-b"\n',
        engine=gate,
        max_inflight=8,
        max_queued=64,
    )
    async with (
        openai_client(app, api_key="sk-a") as flood,
        openai_client(app, api_key="sk-b") as other,
        anyio.create_task_group() as tg,
    ):
        for _ in range(64):
            tg.start_soon(lambda: flood.completions.create(model="echo", prompt="a", max_tokens=1))
        await waiting(app, 56)
        for _ in range(4):
            tg.start_soon(lambda: other.completions.create(model="echo", prompt="b", max_tokens=1))
        await waiting(app, 60)
        gate.release(68)
    after = gate.started[8:]  # what started once B's requests were waiting
    assert gate.started[:8] == ["a"] * 8
    assert [i for i, key in enumerate(after) if key == "b"] == [0, 2, 4, 6]


async def test_the_drains_abort_refuses_the_requests_waiting_for_a_slot() -> None:
    gate = Gate()
    app = app_with('[[key]]\nname = "a"\nkey = "sk-a"\n', engine=gate, max_inflight=1, max_queued=4)
    outcomes: list[Any] = []

    async def ask(api: openai.AsyncOpenAI) -> None:
        try:
            outcomes.append(await api.completions.create(model="echo", prompt="x", max_tokens=1))
        except openai.APIStatusError as error:
            outcomes.append(error.status_code)

    async with openai_client(app, api_key="sk-a") as api, anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(ask, api)
        await waiting(app, 2)
        app.abort()  # (the drain timeout ran out)
        gate.release(3)
    assert sorted(o for o in outcomes if isinstance(o, int)) == [503, 503, 503]


async def test_without_keys_every_client_is_one_and_reads_its_usage() -> None:
    app = build_app(EchoThatEmbeds(), TOKENIZER, model_name="echo")
    async with openai_client(app) as api:
        chat = await api.chat.completions.create(model="echo", messages=HI)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
    usage = (await http.get("/v1/usage")).json()
    assert chat.usage is not None
    assert [(row["key"], row["requests"], row["output_tokens"]) for row in usage["data"]] == [
        ("", 1, chat.usage.completion_tokens)
    ]
    assert (
        "x-ratelimit-limit-requests"
        not in (await http.post("/v1/completions", json={"model": "echo", "prompt": "x"})).headers
    )
