"""Disaggregated serving and KV tiers with the real model, as a user drives them: the
official client against ``llm-pipeline serve --engine llama`` subprocesses.

- ``--prefill-workers 1 --decode-workers 1``: a prefill engine and a decode engine in one
  process, the KV moving between them over TCP; every answer equals the aggregated
  server's, logprobs included, and the decode worker prefills nothing.
- ``--kv-host-cache-mb``: one slot, so a second conversation evicts the first; the first
  one's next turn is restored from host memory, reported cached, and answered as a cold
  server answers it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server_process import ServerProcess

pytestmark = [pytest.mark.llama, pytest.mark.slow]

llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")

MODEL = "SmolLM2-135M-Instruct"
LLAMA = ("--engine", "llama", "--threads", "1")
TOPICS = (
    "the capital of France", "rain", "gravity", "the moon", "bread", "cats", "the sea",
    "winter", "a bicycle", "coffee", "trees", "music", "fire", "a library", "snow",
    "the sun", "a river", "mountains", "a garden", "the wind",
)  # fmt: skip


@pytest.fixture(scope="module")
def aggregated() -> Iterator[ServerProcess]:
    server = ServerProcess(*LLAMA)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def disaggregated() -> Iterator[ServerProcess]:
    server = ServerProcess(*LLAMA, "--prefill-workers", "1", "--decode-workers", "1")
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


async def ask(server: ServerProcess, question: str, **options: Any) -> Any:
    async with client(server) as api:
        return await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            temperature=options.pop("temperature", 0),
            max_tokens=options.pop("max_tokens", 16),
            **options,
        )


def answer(response: Any) -> tuple[Any, ...]:
    """What must be equal: text, finish reason, every token's logprob and alternatives."""
    choice = response.choices[0]
    content = choice.logprobs.content if choice.logprobs else []
    return (
        choice.message.content,
        choice.finish_reason,
        response.usage.completion_tokens,
        [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content],
    )


async def metrics(server: ServerProcess) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{server.url}/metrics")).text
    return {
        (sample.name, sample.labels.get("worker", sample.labels.get("tier", ""))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.time_limit(240)
async def test_twenty_disaggregated_answers_equal_the_aggregated_ones(
    aggregated: ServerProcess, disaggregated: ServerProcess
) -> None:
    """Greedy with logprobs, four requests at a time; the decode worker's prefill counter
    does not move while its transferred-KV counters do."""
    before = await metrics(disaggregated)
    questions = [f"Tell me one fact about {topic}." for topic in TOPICS]
    results: dict[tuple[str, int], Any] = {}
    limit = anyio.Semaphore(4)

    async def one(server: ServerProcess, name: str, index: int) -> None:
        async with limit:
            results[name, index] = await ask(
                server, questions[index], logprobs=True, top_logprobs=2
            )

    for server, name in ((aggregated, "a"), (disaggregated, "d")):
        async with anyio.create_task_group() as tg:
            for index in range(len(questions)):
                tg.start_soon(one, server, name, index)
    for index in range(len(questions)):
        assert answer(results["d", index]) == answer(results["a", index]), questions[index]
    after = await metrics(disaggregated)
    grew = {key: value - before.get(key, 0.0) for key, value in after.items()}
    prompt_tokens = sum(results["d", index].usage.prompt_tokens for index in range(len(questions)))
    assert grew["llm_pipeline_llama_prefill_tokens_total", ""] == 0  # the decode worker's
    assert grew["llm_pipeline_prefill_tokens_total", "decode-0"] == 0
    prefilled = grew["llm_pipeline_prefill_tokens_total", "prefill-0"]
    assert 0 < prefilled <= prompt_tokens
    transferred = grew["llm_pipeline_kv_transferred_tokens_total", ""]
    assert 0 < transferred <= prompt_tokens
    assert grew["llm_pipeline_kv_transferred_bytes_total", ""] == transferred * 23040
    assert grew["llm_pipeline_kv_transfer_recomputed_total", ""] == 0


@pytest.mark.time_limit(120)
async def test_sampling_stop_strings_and_structured_output_survive_the_move(
    aggregated: ServerProcess, disaggregated: ServerProcess
) -> None:
    cases: list[dict[str, Any]] = [
        {"question": "Write a poem about cats.", "temperature": 0.9, "seed": 5},
        {"question": "List the days of the week.", "stop": ["Thursday"], "max_tokens": 40},
        {
            "question": "Give a JSON object with the key name and the value Tom.",
            "response_format": {"type": "json_object"},
            "max_tokens": 60,
        },
    ]
    got = []
    for case in cases:
        question = case.pop("question")
        expected = await ask(aggregated, question, logprobs=True, **case)
        got.append(await ask(disaggregated, question, logprobs=True, **case))
        assert answer(got[-1]) == answer(expected), question
    sampled, stopped, structured = (answer(response) for response in got)
    assert sampled[0]
    assert stopped[0].endswith("Wednesday\n4. ")  # held back until the stop matched
    assert stopped[1] == "stop"
    assert structured[1] == "stop"
    assert isinstance(json.loads(structured[0]), dict)  # a whole JSON object


@pytest.mark.time_limit(120)
async def test_n_above_one_stays_aggregated(
    aggregated: ServerProcess, disaggregated: ServerProcess
) -> None:
    """One handle cannot seed several choices: n=2 runs whole on the decode worker (no
    prefill leg, nothing transferred) and answers as the aggregated server does."""
    question = "Name a colour."
    expected = await ask(aggregated, question, n=2, logprobs=True)
    before = await metrics(disaggregated)
    got = await ask(disaggregated, question, n=2, logprobs=True)
    after = await metrics(disaggregated)
    grew = {key: value - before.get(key, 0.0) for key, value in after.items()}
    assert len(got.choices) == 2
    assert [c.message.content for c in got.choices] == [c.message.content for c in expected.choices]
    assert [[t.logprob for t in c.logprobs.content] for c in got.choices] == [
        [t.logprob for t in c.logprobs.content] for c in expected.choices
    ]
    assert grew["llm_pipeline_prefill_tokens_total", "prefill-0"] == 0
    assert grew["llm_pipeline_prefill_tokens_total", "decode-0"] > 0
    assert grew["llm_pipeline_kv_transferred_tokens_total", ""] == 0


@pytest.mark.time_limit(180)
async def test_the_host_tier_restores_an_evicted_conversation(aggregated: ServerProcess) -> None:
    server = ServerProcess(*LLAMA, "--parallel", "1", "--kv-host-cache-mb", "64")
    try:
        system = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
        history: list[Any] = [system, {"role": "user", "content": "What is the capital of Italy?"}]
        async with client(server) as api:
            first = await api.chat.completions.create(
                model=MODEL, messages=history, temperature=0, max_tokens=12
            )
            await ask(server, "Write a haiku about the sea.")  # takes the only slot
            history += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And of Spain?"},
            ]
            second = await api.chat.completions.create(
                model=MODEL, messages=history, temperature=0, max_tokens=12
            )
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens // 16 * 16  # the first turn, restored
        async with client(aggregated) as api:
            cold = await api.chat.completions.create(
                model=MODEL, messages=history, temperature=0, max_tokens=12
            )
        assert second.choices[0].message.content == cold.choices[0].message.content
        found = await metrics(server)
        assert found["llm_pipeline_kv_tier_hits_total", "host"] >= cached // 16
        assert found["llm_pipeline_kv_restored_tokens_total", "host"] > 0
        assert found["llm_pipeline_kv_saved_blocks_total", "host"] > 0
        assert found["llm_pipeline_kv_tier_hits_total", "disk"] == 0
    finally:
        server.stop()
