"""The OpenAI HTTP server, black-box: a real ``llm-pipeline serve`` subprocess driven by the
official ``openai`` client and by raw SSE over httpx; plus in-process error paths (503, 500,
an error after the stream started) through ``httpx.ASGITransport`` and ScriptedEngine."""

from __future__ import annotations

import itertools
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import orjson
import pytest
from anyio.lowlevel import checkpoint

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.edges.openai.server import OpenAIApp
from operators.engines import echo_logprob
from operators.graph import default_graph
from operators.text.tokenizer import Tokenizer
from pipeline import CapacityExhausted, Context, EngineError, FunctionEngine
from pipeline.testing import ScriptedEngine
from tests.helpers.server_process import ServerProcess, run_cli

pytestmark = pytest.mark.slow

TOKENIZER = Tokenizer.default()
MAX_MODEL_LEN = 512
ERROR_KEYS = {"message", "type", "param", "code"}
SMOLLM2_DIR = Path(__file__).parents[4] / "operators" / "data" / "smollm2"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The default server: echo engine, no delay."""
    process = ServerProcess("--max-model-len", str(MAX_MODEL_LEN))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ServerProcess]:
    """A server whose streams are long: 20 ms per token, prompts cycled, a fault at 30."""
    process = ServerProcess("--echo-delay-ms", "20", "--echo-cycle", "--fail-after-tokens", "30")
    yield process
    process.stop()


@pytest.fixture
async def api(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client, pointed at the default server."""
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="x", max_retries=0, timeout=10
    ) as client:
        yield client


def sse_events(body: str) -> list[Any]:
    """The events of an SSE body: parsed JSON, or the string "[DONE]"."""
    events: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def iter_events(response: httpx.Response) -> AsyncIterator[Any]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else orjson.loads(data)


def completion_text(events: list[Any], index: int = 0) -> str:
    return "".join(
        choice["text"]
        for event in events
        if isinstance(event, dict)
        for choice in event.get("choices", ())
        if choice["index"] == index
    )


def assert_error(body: Any, *, param: str | None = None, code: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    assert body["error"]["code"] == code


async def metric(server_url: str, name: str, labels: str = "") -> float:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{server_url}/metrics")).text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


# ------------------------------------------------------------------------ endpoints


async def test_models_health_and_metrics(server: ServerProcess, api: openai.AsyncOpenAI) -> None:
    models = await api.models.list()
    assert [model.id for model in models.data] == ["echo"]
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        assert (await http.get("/v1/models/echo")).json()["id"] == "echo"
        missing = await http.get("/v1/models/gpt-4")
        assert missing.status_code == 404
        assert_error(missing.json(), param="model", code="model_not_found")
        metrics = await http.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "llm_pipeline_requests_total",
        "llm_pipeline_inflight_requests",
        "llm_pipeline_output_tokens_total",
        "llm_pipeline_time_to_first_token_seconds",
        "llm_pipeline_inter_token_latency_seconds",
        "llm_pipeline_request_duration_seconds",
    ):
        assert re.search(rf"^# TYPE {name} ", metrics.text, re.MULTILINE), name


# ---------------------------------------------------------------------- generation


async def test_chat_stream_and_non_stream_agree(
    server: ServerProcess, api: openai.AsyncOpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "Tell me about the sea, in three words."}]
    full = await api.chat.completions.create(model="echo", messages=messages)
    stream = await api.chat.completions.create(model="echo", messages=messages, stream=True)
    chunks = [chunk async for chunk in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed
    assert "Tell me about the sea, in three words." in streamed
    assert full.choices[0].finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # the role chunk comes first and only once
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    assert chunks[0].choices[0].delta.role == "assistant"


async def test_completion_stream_and_non_stream_agree(
    server: ServerProcess, api: openai.AsyncOpenAI
) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    full = await api.completions.create(model="echo", prompt=prompt, max_tokens=5)
    stream = await api.completions.create(model="echo", prompt=prompt, max_tokens=5, stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert full.choices[0].text == streamed == TOKENIZER.decode(TOKENIZER.encode(prompt)[:5])
    assert full.choices[0].finish_reason == "length"


async def test_stop_string_split_across_tokens_never_leaks(server: ServerProcess) -> None:
    # tokens: "alpha" " beta" " gamma" " delta"; the stop starts inside " beta"
    body = {"model": "echo", "prompt": "alpha beta gamma delta", "stop": ["ta gam"]}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
        response = await http.post("/completions", json={**body, "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    texts = [choice["text"] for e in events[:-1] for choice in e["choices"]]
    assert "".join(texts) == "alpha be"
    assert not any("ta" in text or "gam" in text for text in texts)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [True, False])
async def test_multibyte_characters_arrive_whole(server: ServerProcess, stream: bool) -> None:
    prompt = "Hello 😀 日本語 and 🎉🎉 done"
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
        response = await http.post(
            "/completions", json={"model": "echo", "prompt": prompt, "stream": stream}
        )
    if stream:
        events = sse_events(response.text)
        texts = [choice["text"] for e in events[:-1] for choice in e["choices"]]
        assert not any("\ufffd" in text for text in texts)
        assert "".join(texts) == prompt
    else:
        assert response.json()["choices"][0]["text"] == prompt


async def test_n_choices(server: ServerProcess, api: openai.AsyncOpenAI) -> None:
    stream = await api.completions.create(model="echo", prompt="one two three", n=2, stream=True)
    chunks = [chunk async for chunk in stream]
    texts = {0: "", 1: ""}
    finishes: list[tuple[int, str]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes.append((choice.index, choice.finish_reason))
    assert texts == {0: "one two three", 1: "one two three"}
    assert sorted(finishes) == [(0, "stop"), (1, "stop")]
    full = await api.completions.create(model="echo", prompt="one two three", n=2)
    assert [(c.index, c.text) for c in full.choices] == [(0, "one two three"), (1, "one two three")]


async def test_usage_once_and_right(server: ServerProcess) -> None:
    prompt = "count these tokens please"
    prompt_tokens = len(TOKENIZER.encode(prompt))
    body = {"model": "echo", "prompt": prompt, "stream": True}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
        asked = sse_events(
            (
                await http.post(
                    "/completions", json={**body, "stream_options": {"include_usage": True}}
                )
            ).text
        )
        unasked = sse_events((await http.post("/completions", json=body)).text)
        full = (await http.post("/completions", json={**body, "stream": False})).json()
    expected = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": prompt_tokens,
        "total_tokens": 2 * prompt_tokens,
    }
    usages = [e["usage"] for e in asked[:-1] if e.get("usage") is not None]
    assert usages == [expected]
    assert asked[-2]["choices"] == []
    assert asked[-2]["usage"] == expected
    assert all("usage" not in e for e in unasked[:-1])
    assert full["usage"] == expected


async def test_chat_logprobs_are_aligned_with_a_stop_string(
    server: ServerProcess, api: openai.AsyncOpenAI
) -> None:
    prompt = "alpha beta gamma delta"
    response = await api.completions.create(model="echo", prompt=prompt, stop=["gamma"], logprobs=2)
    choice = response.choices[0]
    assert choice.text == "alpha beta "
    assert choice.logprobs is not None
    ids = TOKENIZER.encode(prompt)
    # " gamma" carries the delivered space and the hidden stop: its entry is included
    tokens = choice.logprobs.tokens
    assert tokens == ["alpha", " beta", " gamma"]
    assert choice.logprobs.token_logprobs == [echo_logprob(i) for i in ids[:3]]
    assert choice.logprobs.text_offset == [0, 5, 10]

    chat = await api.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": prompt}],
        stop=["beta"],
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    entries = []
    content = ""
    async for chunk in chat:
        for part in chunk.choices:
            content += part.delta.content or ""
            if part.logprobs is not None and part.logprobs.content:
                entries.extend(part.logprobs.content)
    assert content.endswith("alpha ")
    joined = "".join(entry.token for entry in entries)
    assert joined.startswith(content)
    assert len(joined) - len(content) < len(entries[-1].token)
    for entry in entries:
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert len(entry.top_logprobs) == 2


async def test_prompt_longer_than_max_model_len_is_400(
    server: ServerProcess, api: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await api.completions.create(model="echo", prompt="word " * (MAX_MODEL_LEN + 10))
    assert raised.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        await api.completions.create(
            model="echo", prompt="word " * (MAX_MODEL_LEN + 10), stream=True
        )


# -------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "echo", "prompt": ', None),
        (b'{"model": "echo", "prompt": "\xff\xfe"}', None),
        (b"[1, 2]", None),
        (b'{"model": "echo", "prompt": "hi", "n": 0}', "n"),
        (b'{"model": "echo", "prompt": "hi", "max_tokens": "many"}', "max_tokens"),
        (b'{"model": "echo"}', "prompt"),
    ],
)
async def test_bad_requests_are_400(server: ServerProcess, body: bytes, param: str | None) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
        response = await http.post(
            "/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        assert_error(response.json(), param=param)
        assert response.json()["error"]["type"] == "invalid_request_error"
        # and the server goes on serving
        ok = await http.post("/completions", json={"model": "echo", "prompt": "still here"})
        assert ok.json()["choices"][0]["text"] == "still here"


async def test_invalid_utf8_is_named(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
        response = await http.post(
            "/chat/completions",
            content=b'{"messages": "\xc3\x28"}',
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    assert "UTF-8" in response.json()["error"]["message"]


async def test_unknown_model_is_404(server: ServerProcess, api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        await api.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.status_code == 404
    assert isinstance(raised.value.body, dict)
    assert_error({"error": raised.value.body}, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        await api.completions.create(model="gpt-4o", prompt="hi", stream=True)


async def test_unknown_paths_and_methods(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        missing = await http.get("/v1/nothing")
        assert missing.status_code == 404
        assert_error(missing.json())
        wrong = await http.get("/v1/completions")
        assert wrong.status_code == 405
        assert wrong.headers["allow"] == "POST"
        assert_error(wrong.json())
        for path in ("/v1/models", "/v1/models/echo", "/health", "/metrics"):
            posted = await http.post(path)
            assert posted.status_code == 405
            assert posted.headers["allow"] == "GET"


async def test_still_serving_after_garbage_bytes(
    server: ServerProcess, api: openai.AsyncOpenAI
) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(b"\x16\x03\x01 this is not HTTP at all\r\n\r\n")
        reply = b""
        with anyio.move_on_after(5):
            try:
                while True:
                    reply += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
    assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
    response = await api.completions.create(model="echo", prompt="alive")
    assert response.choices[0].text == "alive"


# -------------------------------------------------------------- concurrency, timing


async def test_32_concurrent_streams_never_mix(server: ServerProcess) -> None:
    prompts = [f"stream {i} says {' '.join(['word' + str(i)] * (i % 7 + 3))}" for i in range(32)]
    results: dict[int, str] = {}

    async def run(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "echo", "prompt": prompts[i], "stream": True}
        async with http.stream("POST", "/completions", json=body) as response:
            events = [event async for event in iter_events(response)]
        assert events[-1] == "[DONE]"
        results[i] = completion_text(events)

    limits = httpx.Limits(max_connections=32)
    async with (
        httpx.AsyncClient(base_url=server.base_url, timeout=10, limits=limits) as http,
        anyio.create_task_group() as tg,
    ):
        for i in range(32):
            tg.start_soon(run, http, i)
    assert results == dict(enumerate(prompts))


async def test_first_token_on_a_kept_alive_connection_is_not_delayed(
    server: ServerProcess,
) -> None:
    # Nagle's algorithm plus delayed ACKs would hold the first event ~40 ms on a reused
    # connection; the server's sockets have TCP_NODELAY (uvloop sets it).
    body = {"model": "echo", "prompt": "a short prompt", "stream": True}
    times = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
        for _ in range(12):
            start = time.perf_counter()
            first: float | None = None
            async with http.stream("POST", "/completions", json=body) as response:
                async for event in iter_events(response):
                    if first is None and event != "[DONE]" and event["choices"][0]["text"]:
                        first = time.perf_counter() - start
            assert first is not None
            times.append(first)
    assert statistics.median(times[2:]) < 0.02, times


# -------------------------------------------------------------- disconnect, faults


async def test_disconnect_kills_the_request(slow_server: ServerProcess) -> None:
    url = slow_server.url
    labels = '{endpoint="/v1/completions",model="echo",status="499"}'
    gone_before = await metric(url, "llm_pipeline_requests_total", labels)
    body = {"model": "echo", "prompt": "on and on", "stream": True, "max_tokens": 10_000}
    async with httpx.AsyncClient(base_url=slow_server.base_url, timeout=10) as http:
        async with http.stream("POST", "/completions", json=body) as response:
            seen = 0
            async for _ in iter_events(response):
                seen += 1
                if seen == 2:
                    break
    # The server notices the closed socket on its next write (<= one 20 ms token).
    for _ in range(250):
        if await metric(url, "llm_pipeline_inflight_requests") == 0.0:
            break
        await anyio.sleep(0.02)
    assert await metric(url, "llm_pipeline_inflight_requests") == 0.0
    assert await metric(url, "llm_pipeline_requests_total", labels) == gone_before + 1


async def test_a_lost_worker_is_invisible_to_the_client(slow_server: ServerProcess) -> None:
    # --fail-after-tokens 30: the first attempt loses its worker after 30 tokens; Migration
    # continues on another attempt and the client sees the fault-free stream, then [DONE].
    url = slow_server.url
    retried = '{kind="stream",outcome="retried"}'
    before = await metric(url, "llm_pipeline_migrations_total", retried)
    body = {"model": "echo", "prompt": "tick tock", "stream": True, "max_tokens": 40}
    async with httpx.AsyncClient(base_url=slow_server.base_url, timeout=10) as http:
        response = await http.post("/completions", json=body)
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    ids = Tokenizer.default().encode("tick tock")
    expected = Tokenizer.default().decode(list(itertools.islice(itertools.cycle(ids), 40)))
    assert completion_text(events) == expected
    assert await metric(url, "llm_pipeline_migrations_total", retried) == before + 1


async def _stream_until_signal(
    process: ServerProcess, signum: signal.Signals, max_tokens: int
) -> tuple[int, list[Any]]:
    """Stream a completion from ``process``, signal it after the third event, read on."""
    body = {"model": "custom", "prompt": "again", "stream": True, "max_tokens": max_tokens}
    events: list[Any] = []
    code = -1
    async with (
        httpx.AsyncClient(base_url=process.base_url, timeout=30) as http,
        http.stream("POST", "/completions", json=body) as response,
    ):
        async with anyio.create_task_group() as tg:
            async for event in iter_events(response):
                events.append(event)
                if len(events) == 3:

                    async def terminate() -> None:
                        nonlocal code
                        code = await anyio.to_thread.run_sync(process.terminate, signum)

                    tg.start_soon(terminate)
    return code, events


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_lets_a_stream_finish_within_the_drain_timeout(
    signum: signal.Signals,
) -> None:
    process = ServerProcess(
        "--echo-delay-ms", "20", "--echo-cycle", "--tokenizer", str(SMOLLM2_DIR),
        "--model-name", "custom", "--drain-timeout", "20",
    )  # fmt: skip
    try:
        assert process.model == "custom"
        code, events = await _stream_until_signal(process, signum, max_tokens=40)
        assert code == 0
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # earned: 40 tokens
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) == 40
        assert "Traceback" not in process.stderr()
    finally:
        process.stop()


async def test_a_stream_still_running_at_the_drain_timeout_ends_with_an_error() -> None:
    process = ServerProcess(
        "--echo-delay-ms", "20", "--echo-cycle", "--tokenizer", str(SMOLLM2_DIR),
        "--model-name", "custom", "--drain-timeout", "0.3",
    )  # fmt: skip
    try:
        code, events = await _stream_until_signal(process, signal.SIGTERM, max_tokens=10_000)
        assert code == 0
        assert "[DONE]" not in events
        assert_error(events[-1])
        assert events[-1]["error"]["type"] == "service_unavailable_error"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert "Traceback" not in process.stderr()
    finally:
        process.stop()


async def test_a_client_that_stopped_reading_does_not_hold_the_exit() -> None:
    # The client reads its first event, then nothing: the server's writes back up and the
    # drain's error event may never be delivered. The exit is forced after the drain
    # (how soon is the runner's EXIT_AFTER_ABORT; timing is not asserted here).
    process = ServerProcess("--echo-cycle", "--drain-timeout", "0.3", "--model-name", "custom")
    try:
        host, port = process.base_url.removeprefix("http://").removesuffix("/v1").split(":")
        body = orjson.dumps(
            {"model": "custom", "prompt": "again", "stream": True, "max_tokens": 2**31 - 1}
        )
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        with anyio.fail_after(20):
            async with await anyio.connect_tcp(host, int(port)) as stream:
                await stream.send(head.encode() + body)
                assert (await stream.receive()).startswith(b"HTTP/1.1 200")
                code = await anyio.to_thread.run_sync(process.terminate, signal.SIGTERM)
        assert code == 0  # it exited (terminate() waits 15 s at most), and cleanly
        assert "Traceback" not in process.stderr()
    finally:
        process.stop()


def test_the_default_drain_fits_kubernetes_default_grace_period() -> None:
    # SIGKILL comes 30 s after SIGTERM unless terminationGracePeriodSeconds says otherwise.
    from operators.cli.defaults import DEFAULT_DRAIN_TIMEOUT
    from operators.edges.http.runner import DRAIN_TIMEOUT, EXIT_AFTER_ABORT

    assert DEFAULT_DRAIN_TIMEOUT == DRAIN_TIMEOUT
    assert DRAIN_TIMEOUT + EXIT_AFTER_ABORT < 30
    help_text = run_cli(["serve", "--help"]).stdout
    assert "terminationGracePeriodSeconds" in " ".join(help_text.split())


# ------------------------------------------------------------------ the CLI itself


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("llm-pipeline")
    result = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0
    assert "serve" in result.stdout


def test_loadgen_runs_against_the_server(server: ServerProcess) -> None:
    loadgen = Path(__file__).parents[4] / "benchmarks" / "loadgen.py"
    result = subprocess.run(
        [
            sys.executable, str(loadgen), "--url", server.url, "--json", "--warmup", "0",
            "--concurrency", "2", "--requests", "6", "--prompt-tokens", "32",
            "--max-tokens", "8", "--server-pid", str(server.process.pid),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["errors"] == 0, report["first_error"]
    assert report["output_tokens"] == 6 * 8
    # (clock ticks: the CPU time may be 0 for so few tokens; its arithmetic must hold)
    tokens = report["output_tokens"]
    assert report["server_cpu_us_per_token"] == pytest.approx(
        report["server_cpu_s"] * 1e6 / tokens, abs=0.005e6 / tokens + 0.1
    )


def test_help_lists_commands_and_every_serve_option() -> None:
    top = run_cli(["--help"])
    assert top.returncode == 0
    assert "serve" in top.stdout
    serve = run_cli(["serve", "--help"])
    assert serve.returncode == 0
    for option in (
        "--host",
        "--port",
        "--engine",
        "--model-name",
        "--tokenizer",
        "--echo-delay-ms",
        "--echo-cycle",
        "--fail-after-tokens",
        "--max-model-len",
    ):
        assert option in serve.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["serve", "--port", "-1"],
        ["serve", "--engine", "nope"],
        ["serve", "--echo-delay-ms", "x"],
    ],
)
def test_bad_command_lines_exit_2(args: list[str]) -> None:
    result = run_cli(args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_a_missing_tokenizer_is_reported() -> None:
    result = run_cli(["serve", "--tokenizer", "/nonexistent/tokenizer.json"])
    assert result.returncode == 2
    assert "cannot load the tokenizer" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------- in-process: 503, 500, mid-stream


def in_process_app(engine: ScriptedEngine[EngineOutput]) -> OpenAIApp:
    return OpenAIApp(default_graph(engine, TOKENIZER, model_name="m"), model_name="m")


def asgi_client(app: OpenAIApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")


def token_outputs(text: str) -> list[EngineOutput]:
    return [EngineOutput(token_ids=[token_id]) for token_id in TOKENIZER.encode(text)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("error", "status", "type_"),
    [
        (CapacityExhausted("all workers are busy"), 503, "service_unavailable_error"),
        (EngineError("the engine fell over"), 500, "server_error"),
    ],
)
async def test_errors_before_output_get_their_status(
    error: Exception, status: int, type_: str, stream: bool
) -> None:
    app = in_process_app(ScriptedEngine(then=error))
    async with asgi_client(app) as http:
        response = await http.post(
            "/completions", json={"model": "m", "prompt": "hi", "stream": stream}
        )
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert_error(response.json())
    assert response.json()["error"]["type"] == type_
    assert response.json()["error"]["message"] == str(error)
    assert app.inflight == 0
    assert f'status="{status}"' in app.metrics.render().decode()


async def test_unexpected_exceptions_do_not_leak(caplog: pytest.LogCaptureFixture) -> None:
    app = in_process_app(ScriptedEngine(then=RuntimeError("secret path /etc/keys")))
    async with asgi_client(app) as http:
        response = await http.post(
            "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
    assert response.status_code == 500
    assert_error(response.json())
    assert "secret" not in response.text
    assert "secret path" in caplog.text  # logged for the operator, with the traceback


async def test_an_error_mid_stream_is_an_event_and_no_done() -> None:
    engine = ScriptedEngine(token_outputs(" partial output"), then=EngineError("lost the GPU"))
    app = in_process_app(engine)
    async with asgi_client(app) as http:
        response = await http.post(
            "/completions", json={"model": "m", "prompt": "hi", "stream": True}
        )
    assert response.status_code == 200
    events = sse_events(response.text)
    assert "[DONE]" not in events
    assert completion_text(events[:-1]) == " partial output"
    assert_error(events[-1])
    assert events[-1]["error"]["message"] == "lost the GPU"
    assert app.inflight == 0


async def test_drain_refuses_new_requests_and_reports_unhealthy() -> None:
    app = in_process_app(ScriptedEngine(token_outputs("x")))
    app.drain()
    async with asgi_client(app) as http:
        response = await http.post("/completions", json={"prompt": "hi"})
        health = await http.get("http://test/health")
    assert response.status_code == 503
    assert_error(response.json())
    assert health.status_code == 503


async def call_asgi(
    app: OpenAIApp, path: str, body: dict[str, Any], disconnect: anyio.Event | None = None
) -> list[dict[str, Any]]:
    """Run one request through the app and return every ASGI message it sent.

    The client "disconnects" when ``disconnect`` is set (never, if it is None).
    """
    sent: list[dict[str, Any]] = []
    requested = False
    gone = disconnect if disconnect is not None else anyio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    return sent


async def test_chunks_without_new_text_travel_with_the_next_write() -> None:
    app = in_process_app(ScriptedEngine(token_outputs("alpha beta")))
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    sent = await call_asgi(app, "/v1/chat/completions", body)
    assert sent[0]["type"] == "http.response.start"
    writes = [sse_events(message["body"].decode()) for message in sent[1:]]
    # the role chunk rides with the first token; " beta" waits for the engine's next step,
    # which ends the stream at once, so the finish chunk and [DONE] share its write
    assert [[_delta(event) for event in write] for write in writes] == [
        [{"role": "assistant", "content": ""}, {"content": "alpha"}],
        [{"content": " beta"}, {}, "[DONE]"],
    ]
    assert writes[-1][1]["choices"][0]["finish_reason"] == "stop"
    assert sent[-1]["more_body"] is False


def _delta(event: Any) -> Any:
    return event if event == "[DONE]" else event["choices"][0]["delta"]


async def test_a_disconnect_kills_the_request_down_to_the_engine() -> None:
    engine = ScriptedEngine(token_outputs("a b"), then="hang")
    app = in_process_app(engine)
    body = {"model": "m", "prompt": "x", "stream": True}
    async with anyio.create_task_group() as tg:
        tg.start_soon(call_asgi, app, "/v1/completions", body, engine.hanging)
    (leg,) = engine.requests
    assert leg.is_killed
    assert engine.open_streams == 0
    assert app.inflight == 0
    metrics = app.metrics.render().decode()
    assert (
        'llm_pipeline_requests_total{endpoint="/v1/completions",model="m",status="499"} 1.0'
        in metrics
    )
    assert "llm_pipeline_inflight_requests 0.0" in metrics


async def test_ready_events_share_a_write_and_a_wait_flushes_them() -> None:
    """Tokens that are ready when the server asks leave in one write, made when the engine
    next waits; every token is still its own SSE event."""
    proceed = anyio.Event()
    ids = TOKENIZER.encode("one two three four five")

    async def bursty(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        await checkpoint()
        for token_id in ids[:4]:  # a burst: no wait between these
            yield EngineOutput(token_ids=[token_id])
        await proceed.wait()  # a real wait: what is buffered must go out first
        yield EngineOutput(token_ids=[ids[4]], finish_reason="length")

    app = OpenAIApp(
        default_graph(FunctionEngine(bursty), TOKENIZER, model_name="m"), model_name="m"
    )
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if requested:  # the client stays connected
            await anyio.sleep_forever()
        requested = True
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
        return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))
        if b" four" in message.get("body", b""):
            proceed.set()

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    writes = [sse_events(message["body"].decode()) for message in sent[1:]]
    assert [[_delta(event) for event in write] for write in writes] == [
        [{"role": "assistant", "content": ""}, {"content": "one"}],
        [{"content": " two"}, {"content": " three"}, {"content": " four"}],
        [{"content": " five"}, "[DONE]"],
    ]
    assert writes[-1][0]["choices"][0]["finish_reason"] == "length"


async def test_a_write_failing_while_the_engine_waits_closes_the_engine() -> None:
    engine = ScriptedEngine(token_outputs("a b c d"), then="hang")
    app = in_process_app(engine)
    writes = 0
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if requested:  # the client stays connected
            await anyio.sleep_forever()
        requested = True
        body = {"model": "m", "prompt": "x", "stream": True}
        return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal writes
        if message["type"] == "http.response.body":
            writes += 1
            if writes == 2:
                raise OSError("connection reset")

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    with pytest.raises(OSError, match="connection reset"):
        await app(scope, receive, send)
    assert engine.open_streams == 0
    assert app.inflight == 0


async def test_a_disconnect_during_a_blocked_write_kills_the_request() -> None:
    engine = ScriptedEngine(token_outputs("a b c d"), then="hang")
    app = in_process_app(engine)
    blocked = anyio.Event()
    requested = False
    writes = 0

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            body = {"model": "m", "prompt": "x", "stream": True}
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await blocked.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal writes
        if message["type"] == "http.response.body":
            writes += 1
            if writes == 2:  # a client that stopped reading: the write never completes
                blocked.set()
                await anyio.sleep_forever()

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    (leg,) = engine.requests
    assert leg.is_killed
    assert engine.open_streams == 0
    assert app.inflight == 0
    assert 'status="499"} 1.0' in app.metrics.render().decode()
