"""``serve --router kv`` through the HTTP server with the official client: a conversation's
second turn lands on the worker that served its first (seen in /metrics) and prefills less."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from operators import cli
from operators.testing import openai_client
from tests.helpers.router_http import app_for, changed, parse, scrape

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 12


async def conversation_lands_on_one_worker(*argv: str) -> dict[str, dict[str, float]]:
    """Two conversations, interleaved; returns each metric's increase over the 2nd turns."""
    app, _ = app_for("--model-name", "m", "--decode-workers", "4", "--router", "kv", *argv)
    history: dict[str, list[Any]] = {}
    first_worker: dict[str, str] = {}
    async with openai_client(app) as client:
        for name in ("alice", "bob"):  # first turns
            history[name] = [
                {"role": "system", "content": SYSTEM + name},
                {"role": "user", "content": f"Hello, I am {name}. What is a prefix cache?"},
            ]
            before = await scrape(app)
            reply = await client.chat.completions.create(
                model="m",
                messages=history[name],
                max_tokens=8,
            )
            history[name].append(
                {"role": "assistant", "content": reply.choices[0].message.content or ""}
            )
            history[name].append({"role": "user", "content": "And why does routing matter?"})
            [first_worker[name]] = changed(
                before, await scrape(app), "llm_pipeline_router_decisions_total"
            )
        increases: dict[str, dict[str, float]] = {}
        for name in ("alice", "bob"):  # second turns: history + answer + a new question
            before = await scrape(app)
            await client.chat.completions.create(
                model="m",
                messages=history[name],
                max_tokens=8,
            )
            after = await scrape(app)
            decided = changed(before, after, "llm_pipeline_router_decisions_total")
            assert decided == {first_worker[name]: 1.0}, (name, first_worker, decided)
            for metric in ("llm_pipeline_kv_hit_blocks_total", "llm_pipeline_kv_miss_blocks_total"):
                increases.setdefault(metric, {}).update(changed(before, after, metric))
            increases[name] = {
                metric: changed(before, after, metric).get(first_worker[name], 0.0)
                for metric in (
                    "llm_pipeline_prefill_tokens_total",
                    "llm_pipeline_cached_prompt_tokens_total",
                )
            }
    return increases


@pytest.mark.parametrize("repeat", range(3))
async def test_the_second_turn_lands_on_the_first_turns_worker_and_prefills_less(
    repeat: int,
) -> None:
    increases = await conversation_lands_on_one_worker("--engine", "mocker")
    assert increases["llm_pipeline_kv_hit_blocks_total"][""] > 0  # the router saw the prefix
    for name in ("alice", "bob"):
        prefilled = increases[name]["llm_pipeline_prefill_tokens_total"]
        cached = increases[name]["llm_pipeline_cached_prompt_tokens_total"]
        # the first turn's prompt (> 150 tokens of system prompt) came from the cache; only
        # its partial last block, the answer and the new question were computed
        assert cached >= 150
        assert 0 < prefilled < cached


async def first_token_seconds(client: Any, messages: list[Any]) -> tuple[float, str]:
    """Time to the first content of a streamed chat answer, and the whole answer."""
    start = time.perf_counter()
    first: float | None = None
    text = ""
    stream = await client.chat.completions.create(
        model="m", messages=messages, max_tokens=4, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            text += chunk.choices[0].delta.content
    assert first is not None
    return first, text


async def test_the_second_turns_time_to_first_token_drops() -> None:
    # 4 ms of simulated prefill per uncached prompt token: the first turn's ~200-token
    # prompt takes ~0.8 s before its first token; the second turn finds all but its last
    # partial block, the answer and the new question (< 60 tokens, ~0.2 s) cached. The
    # first turn's time is a lower bound the mocker guarantees, so the margin holds on a
    # loaded machine.
    app, _ = app_for(
        "--model-name", "m", "--engine", "mocker", "--decode-workers", "4", "--router", "kv",
        "--mocker-prefill-ms-per-token", "4", "--mocker-decode-ms-per-step", "1",
    )  # fmt: skip
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello. What is a prefix cache?"},
    ]
    async with openai_client(app) as client:
        first_turn, answer = await first_token_seconds(client, messages)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And why does routing matter?"},
        ]
        second_turn, _ = await first_token_seconds(client, messages)
    assert first_turn >= 0.6
    assert second_turn < first_turn / 2, (first_turn, second_turn)


async def test_an_engine_without_kv_events_is_routed_by_approximation() -> None:
    increases = await conversation_lands_on_one_worker("--engine", "echo")
    assert increases["llm_pipeline_kv_hit_blocks_total"][""] > 0


async def test_the_default_router_is_round_robin_and_counts_no_kv_decisions() -> None:
    app, metrics = app_for("--model-name", "m", "--decode-workers", "2", "--engine", "mocker")
    async with openai_client(app) as client:
        for _ in range(2):
            await client.completions.create(model="m", prompt="a b c", max_tokens=2)
    text = metrics.render().decode()
    assert "llm_pipeline_router_decisions_total{" not in text
    assert "llm_pipeline_kv_hit_blocks_total 0.0" in text
    # no --router kv: the mockers keep no cache, as before
    assert 'llm_pipeline_cached_prompt_tokens_total{worker="aggregated-0"} 0.0' in text


def test_the_router_flags_become_the_config() -> None:
    config = cli.ServeConfig.from_args(
        parse(
            "serve",
            "--engine",
            "mocker",
            "--decode-workers",
            "4",
            "--router",
            "kv",
            "--kv-overlap-weight",
            "0.5",
            "--router-temperature",
            "0.1",
            "--kv-block-size",
            "32",
            "--mocker-cache-blocks",
            "128",
        )
    )
    assert (config.router, config.kv_overlap_weight, config.router_temperature) == ("kv", 0.5, 0.1)
    assert (config.engine.kv_block_size, config.engine.mocker_cache_blocks) == (32, 128)


def test_dynamos_flag_names_are_accepted() -> None:
    argv = ("--router", "kv", "--kv-overlap-score-weight", "0.25", "--kv-cache-block-size", "64")
    config = cli.ServeConfig.from_args(parse("serve", *argv))
    assert (config.kv_overlap_weight, config.engine.kv_block_size) == (0.25, 64)


@pytest.mark.parametrize(
    "argv",
    [
        ("--router", "random", "--nats", "nats://127.0.0.1:4222"),
        (
            "--router",
            "sticky",
        ),
    ],
)
def test_a_router_without_in_process_workers_is_a_usage_error(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse("serve", *argv)
    assert caught.value.code == 2


async def test_usage_reports_the_prompt_tokens_found_cached() -> None:
    app, _ = app_for("--model-name", "m", "--engine", "mocker", "--decode-workers", "2",
                     "--router", "kv")  # fmt: skip
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello. What is a prefix cache?"},
    ]
    async with openai_client(app) as client:
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        assert first.usage is not None
        assert first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And why does routing matter?"},
        ]
        stream = await client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
    [usage] = usages
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    # the whole first turn's prompt, in full 16-token blocks, came from the cache
    assert first.usage.prompt_tokens // 16 * 16 <= cached < usage.prompt_tokens
    assert cached % 16 == 0


async def test_usage_has_no_cache_details_when_the_engine_reports_none() -> None:
    app, _ = app_for("--model-name", "m", "--engine", "echo")
    async with openai_client(app) as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens_details is None


async def test_a_retried_request_reports_at_most_its_prompt_as_cached() -> None:
    # Every first attempt loses its worker after 3 tokens; the retry's prompt holds the
    # prompt and the 3 replayed tokens, and finds the prompt cached on the same worker.
    app, _ = app_for("--model-name", "m", "--engine", "mocker", "--decode-workers", "2",
                     "--router", "kv", "--fail-after-tokens", "3")  # fmt: skip
    async with openai_client(app) as client:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": SYSTEM}],
            max_tokens=6,
        )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert 0 < cached <= reply.usage.prompt_tokens


async def test_with_prefill_workers_the_next_turn_is_prefilled_where_its_prefix_is() -> None:
    app, _ = app_for("--model-name", "m", "--engine", "mocker", "--prefill-workers", "3",
                     "--decode-workers", "2", "--router", "kv")  # fmt: skip
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello. What is a prefix cache?"},
    ]
    async with openai_client(app) as client:
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And why does routing matter?"},
        ]
        before = await scrape(app)
        second = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        after = await scrape(app)
    decided = changed(before, after, "llm_pipeline_router_decisions_total")
    # one decision among the prefill workers (the prompt), one among the decode workers
    assert sorted(worker.split("-")[0] for worker in decided) == ["decode", "prefill"]
    [prefill_worker] = [worker for worker in decided if worker.startswith("prefill")]
    cached = changed(before, after, "llm_pipeline_cached_prompt_tokens_total")
    assert cached.get(prefill_worker, 0) >= 150  # the first turn's prompt was found there
    assert second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == cached[prefill_worker]


async def test_the_router_series_say_what_went_where_and_how_loaded_each_worker_is() -> None:
    app, metrics = app_for(
        "--model-name", "m", "--engine", "mocker", "--decode-workers", "3", "--router", "kv"
    )  # fmt: skip
    async with openai_client(app) as client:
        for n in range(6):
            await client.completions.create(model="m", prompt=f"{n} a b c", max_tokens=2)
    families = {
        family.name: family for family in text_string_to_metric_families(metrics.render().decode())
    }
    routed = {
        sample.labels["worker"]: sample.value
        for sample in families["llm_pipeline_router_requests"].samples
        if sample.name.endswith("_total")
    }
    assert set(routed) == {"aggregated-0", "aggregated-1", "aggregated-2"}
    assert sum(routed.values()) == 6
    for name in (
        "llm_pipeline_router_weighed_load_tokens",
        "llm_pipeline_router_reported_prefill_tokens",
        "llm_pipeline_router_reported_sequences",
    ):  # every worker idle again: nothing queued, nothing weighed
        samples = families[name].samples
        assert {s.labels["set"] for s in samples} == {"m aggregated"}
        assert [s.value for s in samples] == [0.0, 0.0, 0.0]
    hits = families["llm_pipeline_router_hit_blocks"].samples
    assert all(sample.labels["worker"].startswith("aggregated-") for sample in hits)
