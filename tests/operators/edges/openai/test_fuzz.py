"""Hostile bodies against both generation endpoints: never a 5xx, always OpenAI's error shape.

Hypothesis writes the bodies: arbitrary JSON, valid requests with one field replaced by a
value of any type, invalid UTF-8, deep nesting, hostile image URLs, unsupported features.
Each goes through the app (raw ASGI, the echo engine behind the default graph), streamed
or not. Whatever comes back is a 2xx or a 4xx; a 4xx is ``{"error": {message, type,
param, code}}`` with ``type`` ``invalid_request_error``; a stream that started ends with
``[DONE]`` or an error event. After every example the app still serves a valid request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, MutableMapping
from typing import Any

import anyio
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators.edges.openai.server import OpenAIApp
from operators.engines.echo import EchoEngine
from operators.graph import default_graph
from operators.text.tokenizer import Tokenizer
from tests.helpers.server_process import ServerProcess

TOKENIZER = Tokenizer.default()
APP = OpenAIApp(
    default_graph(
        EchoEngine.from_tokenizer(TOKENIZER), TOKENIZER, model_name="m", max_model_len=4096
    ),
    model_name="m",
)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
ERROR_KEYS = {"message", "type", "param", "code"}

#: integers at the edges of the machine types an engine might hold a count or an id in
EXTREME_INTS = [
    *(sign * 2**bits + offset for bits in (31, 32, 53, 63, 64) for offset in (-1, 0, 1)
      for sign in (1, -1)),
    10**30,
]  # fmt: skip
integers = st.integers() | st.sampled_from(EXTREME_INTS)
json_values = st.recursive(
    st.none() | st.booleans() | integers | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
hostile_urls = st.sampled_from(
    ["http://[::1", "https://[]/", "http://\u2100.com/", "data:", "data:image/png;base64,",
     "data:image/png;base64,%%%", "javascript:alert(1)", "file:///etc/passwd", "", "//x",
     "http://169.254.169.254/", "https://[::1]:99999/x.png", "http://a b/", "\x00"]
)  # fmt: skip
FIELDS = ["model", "messages", "prompt", "n", "stream", "stream_options", "max_tokens",
          "max_completion_tokens", "stop", "temperature", "top_p", "seed", "presence_penalty",
          "frequency_penalty", "logprobs", "top_logprobs", "echo", "suffix", "min_tokens",
          "ignore_eos", "stop_token_ids", "skip_special_tokens", "response_format", "tools",
          "tool_choice", "logit_bias", "best_of", "user"]  # fmt: skip


def _valid(endpoint: str) -> dict[str, Any]:
    if endpoint.endswith("chat/completions"):
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"model": "m", "prompt": "hi", "max_tokens": 4}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    endpoint = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.sampled_from(["mutated", "json", "bytes", "deep", "image", "mutated"]))
    if kind == "json":
        return endpoint, _dumps(draw(json_values))
    if kind == "bytes":
        return endpoint, draw(st.binary(max_size=64)) + b"\xff\xfe"
    if kind == "deep":
        depth = draw(st.integers(10, 3000))
        return endpoint, b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    body = _valid(endpoint)
    if kind == "image":
        body = _valid("/v1/chat/completions")
        url = draw(hostile_urls)
        body["messages"] = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
        ]
        return "/v1/chat/completions", _dumps(body)
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from(FIELDS))] = draw(json_values)
    body["stream"] = draw(st.booleans()) if draw(st.booleans()) else body.get("stream")
    return endpoint, _dumps(body)


def _dumps(value: Any) -> bytes:
    """JSON as any client may send it: integers of any size, non-ASCII as is."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


async def call(path: str, body: bytes) -> tuple[int, bytes]:
    sent: list[MutableMapping[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
    }
    with anyio.fail_after(10):
        await APP(scope, receive, send)
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:])


def assert_error(error: Any) -> None:
    assert isinstance(error, dict)
    assert set(error) == {"error"}
    assert set(error["error"]) == ERROR_KEYS
    assert isinstance(error["error"]["message"], str)
    assert error["error"]["message"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bodies())
async def test_no_body_gets_a_5xx_and_every_error_is_openai_shaped(case: tuple[str, bytes]) -> None:
    path, body = case
    status, data = await call(path, body)
    assert status < 500, data[:300]
    if status != 200:
        error = orjson.loads(data)
        assert_error(error)
        assert error["error"]["type"] == "invalid_request_error"
    elif data.startswith(b"data: "):
        blocks = [b for b in data.split(b"\n\n") if b]
        last = blocks[-1].removeprefix(b"data: ")
        if last != b"[DONE]":
            assert_error(orjson.loads(last))
    else:
        assert "choices" in orjson.loads(data)
    assert APP.inflight == 0
    ok, _ = await call(path, orjson.dumps(_valid(path)))
    assert ok == 200


#: an app whose limits come from the request alone (no max_model_len to clamp max_tokens),
#: in front of an echo engine that repeats the prompt up to max_tokens
UNBOUNDED = OpenAIApp(
    default_graph(EchoEngine.from_tokenizer(TOKENIZER, cycle=True), TOKENIZER, model_name="m"),
    model_name="m",
)
APP_NO_LIMIT = OpenAIApp(
    default_graph(EchoEngine.from_tokenizer(TOKENIZER), TOKENIZER, model_name="m"),
    model_name="m",
)
#: every integer field of both endpoints: (endpoint, field, how a value is placed)
INTEGER_FIELDS = [
    ("/v1/chat/completions", "max_tokens", "value"),
    ("/v1/chat/completions", "max_completion_tokens", "value"),
    ("/v1/completions", "max_tokens", "value"),
    ("/v1/chat/completions", "min_tokens", "value"),
    ("/v1/chat/completions", "n", "value"),
    ("/v1/chat/completions", "seed", "value"),
    ("/v1/chat/completions", "top_logprobs", "value"),
    ("/v1/completions", "logprobs", "value"),
    ("/v1/chat/completions", "stop_token_ids", "item"),
    ("/v1/completions", "prompt", "item"),
]


@pytest.mark.parametrize(("path", "field", "placed"), INTEGER_FIELDS)
@pytest.mark.parametrize("value", [2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_integer_no_engine_can_hold_is_a_400_naming_its_field(
    path: str, field: str, placed: str, value: int, stream: bool
) -> None:
    # The echo engine once took max_tokens=2**63 to itertools.islice: a 500.
    body = _valid(path) | {"stream": stream}
    if field != "max_tokens":
        body["max_tokens"] = 4
    if field == "top_logprobs":
        body["logprobs"] = True
    body[field] = [value] if placed == "item" else value
    if field == "seed" and -(2**63) <= value < 2**64:
        expected = 200  # any 64-bit seed, signed or not, is a seed
    else:
        expected = 400
    response = await _post(UNBOUNDED, path, body)
    assert response.status_code == expected, response.text
    if expected == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == (f"{field}.0" if placed == "item" else field)
    else:
        assert "error" not in response.text


async def test_the_largest_count_is_served() -> None:
    # 2**31 - 1 is a count every engine can hold: the echo answers the prompt and stops.
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
        body = _valid("/v1/chat/completions") | {field: 2**31 - 1}
        if field == "min_tokens":
            body["max_tokens"] = 2**31 - 1
        response = await _post(APP_NO_LIMIT, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]


async def _post(app: OpenAIApp, path: str, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    with anyio.fail_after(10):
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post(path, json=body)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--max-model-len", "4096", "--model-name", "m")
    yield process
    process.stop()


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bodies())
def test_the_real_server_answers_hostile_bodies_the_same_way(
    server: ServerProcess, case: tuple[str, bytes]
) -> None:
    path, body = case
    base = server.base_url.removesuffix("/v1")
    with httpx.Client(base_url=base, timeout=10) as http:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code < 500, response.text[:300]
        if response.status_code != 200:
            assert_error(response.json())
        health = http.get("/health")
        assert health.status_code == 200
