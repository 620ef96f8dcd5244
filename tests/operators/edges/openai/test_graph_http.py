"""The whole default graph over HTTP with the official client: faults and disaggregation.

Each comparison runs the same requests against two real ``llm-pipeline serve`` processes
that must be indistinguishable to a client: one fault-free, one whose workers die mid-stream
(Migration hides it), or one aggregated and one disaggregated (prefill/decode/encode).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import client_view
from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


@pytest.fixture(scope="module")
def fault_free() -> Iterator[ServerProcess]:
    server = ServerProcess("--echo-cycle")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def faulty() -> Iterator[ServerProcess]:
    server = ServerProcess("--echo-cycle", "--fail-after-tokens", "3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def aggregated() -> Iterator[ServerProcess]:
    server = ServerProcess("--engine", "mocker", "--mocker-decode-ms-per-step", "0.2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def disaggregated() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "--engine",
        "mocker",
        "--mocker-decode-ms-per-step",
        "0.2",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "2",
        "--encode-workers",
        "1",
    )
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=10)


async def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


async def chat_stream(server: ServerProcess, **request: Any) -> dict[str, Any]:
    async with client(server) as api:
        return await client_view.chat_stream(api, model=server.model, **request)


async def chat_once(server: ServerProcess, **request: Any) -> dict[str, Any]:
    async with client(server) as api:
        return await client_view.chat_once(api, model=server.model, **request)


async def test_the_mocker_is_served_as_mocker(aggregated: ServerProcess) -> None:
    assert aggregated.model == "mocker"  # its banner: "serving model 'mocker'"
    async with client(aggregated) as api:
        assert [model.id async for model in api.models.list()] == ["mocker"]


REQUESTS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 12},
    {
        "messages": [{"role": "user", "content": "say ozzy osbourne twice: ozzy osbourne"}],
        "max_tokens": 40,
        "stop": ["bourne tw"],
        "logprobs": True,
        "top_logprobs": 2,
    },
    {"messages": [{"role": "user", "content": "héllo 🥳 你好 wörld"}], "max_tokens": 9},
]


@pytest.mark.parametrize("request_body", REQUESTS, ids=["plain", "stop+logprobs", "unicode"])
async def test_lost_workers_are_invisible_over_http(
    fault_free: ServerProcess, faulty: ServerProcess, request_body: dict[str, Any]
) -> None:
    retried = '{kind="stream",outcome="retried"}'
    before = await metric(faulty, "llm_pipeline_migrations_total", retried)
    expected = await chat_stream(fault_free, **request_body)
    assert expected["finishes"]
    assert await chat_stream(faulty, **request_body) == expected
    assert await chat_once(faulty, **request_body) == await chat_once(fault_free, **request_body)
    assert await chat_once(faulty, **request_body) == {**expected}
    assert await metric(faulty, "llm_pipeline_migrations_total", retried) == before + 3


def image_part(data: bytes = PNG, mime: str = "image/png") -> dict[str, Any]:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


async def test_disaggregated_graph_answers_like_the_aggregated_one(
    aggregated: ServerProcess, disaggregated: ServerProcess
) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is in this picture?"}, image_part()],
        }
    ]
    for body in (
        {"messages": messages, "max_tokens": 20},
        {"messages": [{"role": "user", "content": "no image here"}], "max_tokens": 1},
        {"messages": [{"role": "user", "content": "a longer one"}], "max_tokens": 24},
    ):
        want = await chat_stream(aggregated, **body)
        assert await chat_stream(disaggregated, **body) == want
        assert await chat_once(disaggregated, **body) == await chat_once(aggregated, **body)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (image_part(b"not an image"), "not a valid image/png"),
        (image_part(PNG, "image/tiff"), "unsupported image type"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}, "host"),
    ],
)
async def test_bad_images_get_400_naming_the_part(
    disaggregated: ServerProcess, part: dict[str, Any], message: str
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    async with client(disaggregated) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(model="mocker", messages=messages)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict)
    assert message in error["message"]
    assert error["param"] == "messages.0.content.1"
