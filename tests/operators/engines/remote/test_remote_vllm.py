"""Two unmodified vLLM servers (the CPU build, SmolLM2) behind ``llm-pipeline serve --engine
remote --router kv``, driven with the official clients: answers equal vLLM's own token for
token, stop strings never leak, ``n`` and logprobs, a client's disconnect aborts inside
vLLM, a conversation's next turn lands where its KV is, Responses and Messages work, and
``kill -9`` of a server mid-stream is invisible to the client (the last test: it kills one).

The servers are started once for the module, side by side (a minute on two cores), and
stopped at its end.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from operators.engines.vllm import default_model_dir
from tests.helpers.server_process import ServerProcess
from tests.helpers.vllm_support import requires_vllm
from tests.operators.engines.remote.vllm_servers import MODEL_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.time_limit(120)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm."}]
#: a system prompt of several KV blocks, shared by every conversation
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6


class Deployment:
    def __init__(self) -> None:
        model = str(default_model_dir())
        self.vllm = [VllmServer(model), VllmServer(model)]
        self.server: ServerProcess | None = None
        try:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda v: v.wait_ready(), self.vllm))
            self.server = ServerProcess(
                "--engine", "remote", "--router", "kv", "--kv-block-size", "16",
                "--upstream", self.vllm[0].upstream, "--upstream", self.vllm[1].upstream,
                "--upstream-poll-ms", "200", "--log-level", "info",
            )  # fmt: skip
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        for server in self.vllm:
            server.stop()


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    requires_vllm()
    deployment = Deployment()
    try:
        yield deployment
    finally:
        deployment.close()


def api(deployment: Deployment) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{deployment.url}/v1", api_key="x", max_retries=0, timeout=100
    )


def direct(server: VllmServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=100)


async def scrape(deployment: Deployment) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{deployment.url}/metrics")).text
    return {
        (sample.name, sample.labels.get("upstream", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def served_by(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> set[str]:
    name = "llm_pipeline_upstream_requests_total"
    return {
        upstream
        for (sample, upstream), value in after.items()
        if sample == name and value > before.get((sample, upstream), 0.0)
    }


async def test_greedy_answers_equal_vllms_own_token_for_token(deployment: Deployment) -> None:
    async with api(deployment) as ours, direct(deployment.vllm[0]) as theirs:
        chat: dict[str, Any] = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 30,
                                "temperature": 0, "logprobs": True}  # fmt: skip
        mine, reference = (
            await ours.chat.completions.create(**chat),
            await theirs.chat.completions.create(**chat),
        )
        assert mine.choices[0].message.content == reference.choices[0].message.content
        assert "Paris" in (mine.choices[0].message.content or "")
        assert mine.usage is not None
        assert reference.usage is not None
        assert (mine.usage.prompt_tokens, mine.usage.completion_tokens) == (
            reference.usage.prompt_tokens, reference.usage.completion_tokens
        )  # fmt: skip
        ours_lp = mine.choices[0].logprobs
        theirs_lp = reference.choices[0].logprobs
        assert ours_lp is not None
        assert theirs_lp is not None
        tokens = [t.token for t in ours_lp.content or ()]
        values = [t.logprob for t in ours_lp.content or ()]
        # (vLLM lists the end-of-turn token it stopped at; our edge, as OpenAI, does not)
        assert [t.token for t in theirs_lp.content or ()] in (tokens, [*tokens, "<|im_end|>"])
        assert values == pytest.approx(
            [t.logprob for t in theirs_lp.content or ()][: len(values)], abs=1e-4
        )
        text: dict[str, Any] = {"model": MODEL_NAME, "prompt": "The capital of France is",
                                "max_tokens": 20, "temperature": 0}  # fmt: skip
        mine_text = await ours.completions.create(**text)
        reference_text = await theirs.completions.create(**text)
        assert mine_text.choices[0].text == reference_text.choices[0].text
        assert mine_text.choices[0].finish_reason == reference_text.choices[0].finish_reason


async def test_a_stop_string_split_across_tokens_never_leaks(deployment: Deployment) -> None:
    async with api(deployment) as ours, direct(deployment.vllm[1]) as theirs:
        whole = await theirs.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, max_tokens=30, temperature=0
        )
        answer = whole.choices[0].message.content or ""
        assert " is Paris" in answer  # " is" and " Paris" are two tokens: "is Par" spans them
        stream = await ours.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, max_tokens=30, temperature=0, stop=["is Par"],
            stream=True,
        )  # fmt: skip
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == answer[: answer.index("is Par")]
        assert not any("Par" in piece for piece in pieces)


async def test_n_choices_and_top_logprobs_are_vllms(deployment: Deployment) -> None:
    async with api(deployment) as ours, direct(deployment.vllm[0]) as theirs:
        mine = await ours.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, max_tokens=12, temperature=0, n=2,
            logprobs=True, top_logprobs=3,
        )  # fmt: skip
        reference = await theirs.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, max_tokens=12, temperature=0,
            logprobs=True, top_logprobs=3,
        )  # fmt: skip
        expected = reference.choices[0]
        assert expected.logprobs is not None
        assert expected.logprobs.content
        assert len(mine.choices) == 2
        for choice in mine.choices:
            assert choice.message.content == expected.message.content
            assert choice.logprobs is not None
            assert choice.logprobs.content
            ours, theirs = choice.logprobs.content, expected.logprobs.content
            # (vLLM also lists the end-of-turn token it stopped at; our edge does not)
            assert [t.token for t in theirs[len(ours) :]] in ([], ["<|im_end|>"])
            for got, want in zip(ours, theirs, strict=False):
                assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
                assert [t.logprob for t in got.top_logprobs] == pytest.approx(
                    [t.logprob for t in want.top_logprobs], abs=1e-4
                )


async def test_a_client_disconnect_aborts_inside_vllm(deployment: Deployment) -> None:
    servers = deployment.vllm
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": MODEL_NAME, "messages": STORY, "max_tokens": 1000, "stream": True}
        async with http.stream("POST", f"{deployment.url}/v1/chat/completions", json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                chunks += '"content"' in line
                if chunks == 5:
                    assert sum(server.running() for server in servers) == 1
                    break  # the client goes away
    with anyio.fail_after(10):
        while sum(server.running() for server in servers):  # noqa: ASYNC110 - vLLM's own count
            await anyio.sleep(0.1)


async def test_a_conversations_next_turn_lands_on_its_server_and_reuses_its_cache(
    deployment: Deployment,
) -> None:
    chosen: set[str] = set()
    async with api(deployment) as ours:
        for topic in ("tides", "volcanoes", "glaciers"):
            messages: list[dict[str, str]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me about {topic}, in detail, please. " * 4},
            ]
            before = await scrape(deployment)
            first = await ours.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=8,
                temperature=0,  # type: ignore[arg-type]
            )
            middle = await scrape(deployment)
            [upstream] = served_by(before, middle)
            chosen.add(upstream)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": f"And what else about {topic}?"},
            ]
            second = await ours.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=8,
                temperature=0,  # type: ignore[arg-type]
            )
            after = await scrape(deployment)
            assert served_by(middle, after) == {upstream}, topic
            hits = after[("llm_pipeline_kv_hit_blocks_total", "")]
            assert hits - middle[("llm_pipeline_kv_hit_blocks_total", "")] >= 8, topic
            assert first.usage is not None
            assert second.usage is not None
            details = second.usage.prompt_tokens_details
            assert details is not None
            assert details.cached_tokens is not None
            assert details.cached_tokens >= first.usage.prompt_tokens - 32, topic
    assert chosen <= {server.url[7:] for server in deployment.vllm}


async def test_responses_and_messages_work_in_front_of_vllm(deployment: Deployment) -> None:
    async with api(deployment) as ours:
        response = await ours.responses.create(
            model=MODEL_NAME, input="What is the capital of France?", max_output_tokens=30,
            temperature=0,
        )  # fmt: skip
        assert "Paris" in response.output_text
    messages = anthropic.AsyncAnthropic(base_url=deployment.url, api_key="x", max_retries=0)
    async with messages:
        message = await messages.messages.create(
            model=MODEL_NAME, max_tokens=30, messages=QUESTION,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
        )  # fmt: skip
    assert message.content[0].type == "text"
    assert "Paris" in message.content[0].text


async def test_kill_9_of_a_server_mid_stream_is_invisible_to_the_client(
    deployment: Deployment,
) -> None:
    """(The last test: it leaves one server.)"""
    async with direct(deployment.vllm[0]) as theirs:
        reference = await theirs.chat.completions.create(
            model=MODEL_NAME, messages=STORY, max_tokens=80, temperature=0
        )
    expected = reference.choices[0].message.content or ""
    before = await scrape(deployment)
    pieces: list[str] = []
    async with api(deployment) as ours:
        stream = await ours.chat.completions.create(
            model=MODEL_NAME, messages=STORY, max_tokens=80, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if len(pieces) == 10:
                [upstream] = served_by(before, await scrape(deployment))
                [victim] = [s for s in deployment.vllm if s.url.endswith(upstream)]
                victim.kill()
    assert "".join(pieces) == expected
    after = await scrape(deployment)
    assert after[("llm_pipeline_upstream_lost_total", upstream)] >= 1
    assert after[("llm_pipeline_upstream_up", upstream)] == 0
