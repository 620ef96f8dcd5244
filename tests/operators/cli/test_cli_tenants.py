"""``serve --api-keys FILE`` as its users see it: real servers, the official ``openai`` and
``anthropic`` clients. The SDKs' own retries wait what a 429 says and then succeed; a
flooding key does not starve another (the JSON request log's admission order); usage per
key equals what the responses said, cached tokens included; SIGHUP reloads the keys
without dropping a request, and a broken file is refused, naming its line."""

from __future__ import annotations

import importlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from tests.helpers.server_process import ServerProcess, run_cli

HI: Any = [{"role": "user", "content": "hi"}]


def keys_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


async def wait_until(condition: Callable[[], bool], within: float) -> None:
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - another process, no event to wait on
            await anyio.sleep(0.02)


def metric(server: ServerProcess, line: str) -> float:
    """The value of the /metrics series ``line`` (0 when absent)."""
    for row in httpx.get(f"{server.url}/metrics").text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def request_lines(server: ServerProcess) -> list[dict[str, Any]]:
    """The JSON request log's lines so far."""
    found = []
    for line in server.stderr().splitlines():
        if line.startswith("{") and '"llm_pipeline.requests"' in line:
            found.append(json.loads(line))
    return found


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    for server in servers:
        server.stop()


def test_a_broken_keys_file_stops_the_server_naming_the_line(tmp_path: Path) -> None:
    path = keys_file(tmp_path / "keys.toml", '[[key]]\nname = "a"\nkey = "k"\nmax_inflight = -3\n')
    result = run_cli(["serve", "--port", "0", "--api-keys", str(path)])
    assert result.returncode == 2
    assert f"{path} line 4: key 'a': 'max_inflight' must be an integer" in result.stderr
    assert "Traceback" not in result.stderr


class Attempts:
    """Every response an SDK's client saw (an httpx event hook), with when it came."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, int, httpx.Headers]] = []
        self.sent: list[float] = []

    async def request(self, request: Any) -> None:
        self.sent.append(time.monotonic())

    async def response(self, response: Any) -> None:
        self.seen.append((time.monotonic(), response.status_code, response.headers))

    def check_waits(self) -> int:
        """Each retry came no sooner than the 429 before it said; the retries."""
        retries = 0
        for (when, status, headers), sent in zip(self.seen, self.sent[1:], strict=False):
            if status == 429:
                retries += 1
                wait = int(headers["retry-after-ms"]) / 1000
                assert sent - when >= wait - 0.005, (sent - when, wait)
        return retries


@pytest.mark.time_limit(40)
async def test_the_sdks_wait_what_a_429_says_and_then_succeed(
    tmp_path: Path, started: list[ServerProcess]
) -> None:
    """6000 tokens a minute refill 100 a second: a request that overshoots what is left by
    ~100 tokens is told to wait about a second, and the SDK's retry (after exactly that)
    is admitted."""
    path = keys_file(
        tmp_path / "keys.toml",
        '[[key]]\nname = "a"\nkey = "sk-a"\ntokens_per_minute = 6000\n'
        '[[key]]\nname = "b"\nkey = "sk-b"\ntokens_per_minute = 6000\n',
    )
    server = ServerProcess("--api-keys", str(path), "--echo-cycle")
    started.append(server)
    attempts = Attempts()
    hooks = {"request": [attempts.request], "response": [attempts.response]}
    http = httpx.AsyncClient(event_hooks=hooks)
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="sk-a", max_retries=3, http_client=http
    ) as api:
        first = await api.completions.create(model="echo", prompt="hello", max_tokens=5000)
        assert first.usage is not None
        left = 6000 - first.usage.total_tokens
        second = await api.completions.create(model="echo", prompt="hello", max_tokens=left + 90)
    assert second.choices[0].finish_reason == "length"
    assert 1 <= attempts.check_waits() <= 2
    assert [status for _, status, _ in attempts.seen][-1] == 200

    anthropic_attempts = Attempts()
    hooks = {"request": [anthropic_attempts.request], "response": [anthropic_attempts.response]}
    try:  # (the SDK's own httpx: recent versions ship a fork)
        http_module: Any = importlib.import_module("httpx2")
    except ImportError:
        http_module = httpx
    claude_http = http_module.AsyncClient(event_hooks=hooks)
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="sk-b", max_retries=3, http_client=claude_http
    ) as claude:
        drained = await claude.messages.create(model="echo", max_tokens=5000, messages=HI)
        used = drained.usage.input_tokens + drained.usage.output_tokens
        again = await claude.messages.create(model="echo", max_tokens=6000 - used + 90, messages=HI)
    assert again.stop_reason == "max_tokens"
    assert 1 <= anthropic_attempts.check_waits() <= 2
    status = 'llm_pipeline_key_requests_total{{key="{}",model="echo",status="429"}}'
    assert metric(server, status.format("a")) == attempts.check_waits()
    assert metric(server, status.format("b")) == anthropic_attempts.check_waits()


@pytest.mark.time_limit(60)
async def test_a_flooding_key_does_not_starve_another(
    tmp_path: Path, started: list[ServerProcess]
) -> None:
    """Key A floods 64 concurrent requests, key B then sends 4, at one priority, 8 slots:
    of the admissions after B's requests arrived, B's are among the first 8 (every other
    slot, its fair share), not after A's 56 waiting ones. Read off the JSON request log's
    admission numbers, not the clock."""
    path = keys_file(
        tmp_path / "keys.toml",
        '[[key]]\nname = "a"\nkey = "sk-a"\n[[key]]\nname = "b"\nkey = "sk-b"\n',
    )
    server = ServerProcess(
        "--api-keys", str(path), "--max-inflight", "8", "--max-queued", "64",
        "--echo-cycle", "--echo-delay-ms", "10", "--log-format", "json",
    )  # fmt: skip
    started.append(server)
    flood = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-a", max_retries=0)
    other = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-b", max_retries=0)
    async with flood, other, anyio.create_task_group() as tg:
        for _ in range(64):
            tg.start_soon(lambda: flood.completions.create(model="echo", prompt="a", max_tokens=60))
        await wait_until(lambda: metric(server, "llm_pipeline_waiting_requests") >= 50, 20)
        for _ in range(4):
            tg.start_soon(lambda: other.completions.create(model="echo", prompt="b", max_tokens=60))
    await wait_until(lambda: len(request_lines(server)) == 68, 10)
    lines = request_lines(server)
    assert {line["status"] for line in lines} == {200}
    b_lines = [line for line in lines if line["key"] == "b"]
    came = min(line["arrival"] for line in b_lines)
    later = sorted((line["admission"], line["key"]) for line in lines if line["admission"] > came)
    assert len(later) >= 40  # (B came while most of A's flood still waited)
    assert [key for _, key in later[:8]].count("b") == 4, later[:10]


@pytest.mark.time_limit(40)
async def test_usage_per_key_is_what_the_responses_said_cached_tokens_included(
    tmp_path: Path, started: list[ServerProcess]
) -> None:
    path = keys_file(
        tmp_path / "keys.toml",
        '[[key]]\nname = "a"\nkey = "sk-a"\n[[key]]\nname = "ops"\nkey = "sk-ops"\nadmin = true\n',
    )
    server = ServerProcess(
        "--api-keys", str(path), "--engine", "mocker", "--mocker-cache-blocks", "256",
        "--mocker-prefill-ms-per-token", "0", "--mocker-decode-ms-per-step", "0",
        "--log-format", "json",
    )  # fmt: skip
    started.append(server)
    model = server.model
    long: Any = [{"role": "user", "content": "tell me a story " * 20}]
    prompt = cached = output = 0
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-a") as api:
        for _ in range(2):  # the second finds the first's prompt cached
            chat = await api.chat.completions.create(model=model, messages=long, max_tokens=8)
            assert chat.usage is not None
            details = chat.usage.prompt_tokens_details
            prompt += chat.usage.prompt_tokens
            cached += details.cached_tokens or 0 if details is not None else 0
            output += chat.usage.completion_tokens
            response = await api.responses.create(
                model=model, input="tell me a story " * 20, max_output_tokens=8
            )
            assert response.usage is not None
            prompt += response.usage.input_tokens
            cached += response.usage.input_tokens_details.cached_tokens
            output += response.usage.output_tokens
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="sk-a") as claude:
        for _ in range(2):
            message = await claude.messages.create(model=model, max_tokens=8, messages=long)
            read = message.usage.cache_read_input_tokens or 0
            prompt += message.usage.input_tokens + read
            cached += read
            output += message.usage.output_tokens
    assert cached > 0  # (what this test is about: cached tokens are counted too)
    async with httpx.AsyncClient() as http:
        answer = await http.get(
            f"{server.base_url}/usage?key=a", headers={"authorization": "Bearer sk-ops"}
        )
    usage = answer.json()
    [row] = usage["data"]
    assert (row["key"], row["requests"], row["statuses"]) == ("a", 6, {"200": 6})
    assert (row["prompt_tokens"], row["cached_tokens"], row["output_tokens"]) == (
        prompt,
        cached,
        output,
    )

    def series(kind: str) -> str:
        return f'llm_pipeline_key_tokens_total{{key="a",kind="{kind}",model="{model}"}}'

    assert metric(server, series("prompt")) == prompt
    assert metric(server, series("cached")) == cached
    assert metric(server, series("output")) == output
    await wait_until(lambda: len(request_lines(server)) == 6, 5)
    lines = request_lines(server)
    assert {line["key"] for line in lines} == {"a"}
    assert sum(line["prompt_tokens"] for line in lines) == prompt
    assert sum(line["cached_tokens"] or 0 for line in lines) == cached
    assert "sk-a" not in server.stderr()


@pytest.mark.time_limit(40)
async def test_sighup_reloads_the_keys_without_dropping_a_request(
    tmp_path: Path, started: list[ServerProcess]
) -> None:
    path = keys_file(tmp_path / "keys.toml", '[[key]]\nname = "old"\nkey = "sk-old"\n')
    server = ServerProcess(
        "--api-keys", str(path), "--echo-cycle", "--echo-delay-ms", "20", "--log-level", "info"
    )
    started.append(server)
    old = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-old", max_retries=0)
    new = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-new", max_retries=0)
    async with old, new:
        stream = await old.completions.create(
            model="echo", prompt="going on", max_tokens=60, stream=True
        )
        text = [await anext(aiter(stream))]  # in flight, under the old keys
        keys_file(path, '[[key]]\nname = "new"\nkey = "sk-new"\n')
        server.process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "SIGHUP: reloaded" in server.stderr(), 10)
        assert (await new.completions.create(model="echo", prompt="x", max_tokens=2)).choices
        with pytest.raises(openai.AuthenticationError):
            await old.completions.create(model="echo", prompt="x", max_tokens=2)
        text += [chunk async for chunk in stream]  # the old key's request finished
        assert text[-1].choices[0].finish_reason == "length"
        assert sum(len(chunk.choices) for chunk in text) >= 60

        keys_file(path, '[[key]]\nname = "broken"\nkey = "sk-x"\nrequests_per_minute = "many"\n')
        server.process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "the keys stay as they were" in server.stderr(), 10)
        assert "line 4" in server.stderr().rsplit("the keys stay as they were", 1)[1]
        assert (await new.completions.create(model="echo", prompt="x", max_tokens=2)).choices
    assert server.process.poll() is None
    assert "Traceback" not in server.stderr()
