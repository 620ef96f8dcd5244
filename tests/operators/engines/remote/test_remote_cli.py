"""``llm-pipeline serve --engine remote`` (and ``worker --engine remote``) as subprocesses in
front of fake upstreams (``fake_upstream``, in this process): migration across upstreams,
a client's disconnect reaching the upstream, the status page and metrics, ``--models``,
and every usage error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from operators.text.tokenizer import Tokenizer
from tests.helpers.server_process import ServerProcess, run_cli
from tests.operators.engines.remote.fake_upstream import FakeUpstream, continuation

pytestmark = [pytest.mark.slow, pytest.mark.time_limit(30)]

TOKENIZER = Tokenizer.default()
PROMPT = "Once upon a time"


@pytest.fixture
def pair() -> Iterator[tuple[FakeUpstream, FakeUpstream]]:
    first, second = FakeUpstream("vllm"), FakeUpstream("vllm")
    yield first, second
    first.stop()
    second.stop()


def expected(max_tokens: int) -> str:
    return TOKENIZER.decode(continuation(TOKENIZER.encode(PROMPT), max_tokens))


async def samples(server: ServerProcess) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    return {
        (sample.name, sample.labels.get("upstream", sample.labels.get("kind", ""))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_a_stream_lost_mid_way_continues_on_the_other_upstream(
    pair: tuple[FakeUpstream, FakeUpstream],
) -> None:
    first, second = pair
    first.faults.reset_after = 4  # round-robin: the first request goes to the first upstream
    server = ServerProcess(
        "--engine", "remote", "--upstream", first.url, "--upstream", second.url,
        "--upstream-poll-ms", "50",
    )  # fmt: skip
    try:
        assert server.model == "fake-model"  # the upstreams' own name
        api = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        async with api:
            stream = await api.completions.create(
                model="fake-model", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
            )
            text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        assert text == expected(12)
        assert (first.counts.requests, second.counts.requests) == (1, 1)
        # the retry continued from prompt + the 4 tokens the first upstream sent
        _, retried = second.counts.bodies[-1]
        assert retried["token_ids"][-4:] == continuation(TOKENIZER.encode(PROMPT), 4)
        found = await samples(server)
        assert found[("llm_pipeline_migrations_total", "stream")] == 1
        assert found[("llm_pipeline_upstream_lost_total", first.url[7:])] == 1
        assert found[("llm_pipeline_upstream_requests_total", second.url[7:])] == 1
        async with httpx.AsyncClient() as http:
            status = (await http.get(f"{server.url}/status")).json()
        assert {row["where"] for row in status["workers"]} == {
            f"vllm at {first.url}",
            f"vllm at {second.url}",
        }
    finally:
        server.stop()


async def test_a_client_gone_closes_the_upstreams_stream(
    pair: tuple[FakeUpstream, FakeUpstream],
) -> None:
    first, _ = pair
    first.delay = 0.05
    server = ServerProcess("--engine", "remote", "--upstream", first.url, "--model-name", "m")
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1000, "stream": True}  # fmt: skip
            async with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if '"content"' in line:
                        break  # the client goes away
        with anyio.fail_after(10):
            while first.counts.aborted < 1:  # noqa: ASYNC110 - counted in the fake's thread
                await anyio.sleep(0.02)
        assert first.counts.running == 0
    finally:
        server.stop()


async def test_models_tables_take_the_remote_options(
    pair: tuple[FakeUpstream, FakeUpstream], tmp_path: Path
) -> None:
    first, second = pair
    models = tmp_path / "models.toml"
    models.write_text(
        f'[[model]]\nname = "a"\nengine = "remote"\nupstream = ["{first.url}"]\n'
        f'[[model]]\nname = "b"\nengine = "remote"\nupstream = ["{second.url}"]\n'
        'upstream-kind = "vllm"\nupstream-poll-ms = 100\n'
    )
    server = ServerProcess("--models", str(models))
    try:
        api = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        async with api:
            for name in ("a", "b"):
                answer = await api.completions.create(model=name, prompt=PROMPT, max_tokens=5)
                assert answer.choices[0].text == expected(5)
        assert (first.counts.requests, second.counts.requests) == (1, 1)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--upstream", "http://h:1"], "--upstream needs --engine remote"),
        (["serve", "--engine", "remote"], "--engine remote needs --upstream"),
        (["serve", "--engine", "remote", "--upstream", "h:1"], "expected an http(s) URL"),
        (["serve", "--engine", "remote", "--upstream", "http://h:1,kv=x"], "kv= takes"),
        (["serve", "--engine", "remote", "--upstream", "http://h:1", "--decode-workers", "2"],
         "routes over its upstreams"),
        (["worker", "--nats", "nats://x:1", "--engine", "remote", "--upstream", "http://a:1",
          "--upstream", "http://b:1"], "fronts one upstream"),
    ],
)  # fmt: skip
def test_usage_errors_name_what_is_wrong(args: list[str], message: str) -> None:
    result = run_cli(args)
    assert result.returncode == 2
    assert message in result.stderr


def test_no_upstream_answering_is_exit_code_1() -> None:
    result = run_cli(["serve", "--engine", "remote", "--upstream", "http://127.0.0.1:9"])
    assert result.returncode == 1
    assert "no upstream answered" in result.stderr


async def test_a_worker_fronts_one_upstream_over_nats(
    pair: tuple[FakeUpstream, FakeUpstream], tmp_path: Path
) -> None:
    pytest.importorskip("nats", reason="the NATS tests need the nats extra")
    from tests.helpers.nats_server import NatsServer
    from tests.operators.cli.test_cli_nats import WorkerProcess

    first, _ = pair
    nats = NatsServer(tmp_path)
    nats.start()
    worker = WorkerProcess(nats.url, "fronting", "--engine", "remote", "--upstream", first.url)
    server: ServerProcess | None = None
    try:
        worker.wait_ready()
        assert "serving model 'fake-model'" in worker.ready_line  # the upstream's name
        server = ServerProcess("--nats", nats.url, "--model-name", "fake-model")
        api = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        async with api:
            answer = await api.completions.create(model="fake-model", prompt=PROMPT, max_tokens=6)
        assert answer.choices[0].text == expected(6)
        # the worker's engine answered its first probe (one prompt token) before the
        # worker joined routing; then the request
        assert first.counts.requests == 2
        (_, probe), (_, asked) = first.counts.bodies
        assert len(probe["token_ids"]) == 1
        assert len(asked["token_ids"]) > 1
    finally:
        if server is not None:
            server.stop()
        worker.stop()
        nats.stop()
