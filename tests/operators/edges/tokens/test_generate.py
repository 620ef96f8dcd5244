"""``POST /inference/v1/generate``: vLLM's tokens-in/tokens-out endpoint, in process.

The shapes (whole and streamed, logprobs, usage with cached tokens), the stop rules on ids
and text, Migration, the API key, admission, and every refusal by name. Our own remote
engine as its client, over real servers, is ``tests/operators/test_remote_of_serve.py``.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import orjson
import pytest

from operators.contracts.llm import EngineOutput
from operators.edges.http.guard import Guard
from operators.edges.openai.server import OpenAIApp
from operators.engines.mocker import MockerEngine
from operators.serving import build_app
from operators.text.tokenizer import Tokenizer
from pipeline import Router, WorkerSet
from pipeline.testing import ScriptedEngine

TOKENIZER = Tokenizer.default()
PROMPT = TOKENIZER.encode("Once upon a time there was a router")
CONTEXT = 512


def app_of(engine: Any = None, **options: Any) -> OpenAIApp:
    engine = engine or MockerEngine.from_tokenizer(TOKENIZER, cache_blocks=64)
    return build_app(engine, TOKENIZER, model_name="m", max_model_len=CONTEXT, **options)


def client(app: OpenAIApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


async def generate(app: OpenAIApp, **body: Any) -> httpx.Response:
    async with client(app) as http:
        return await http.post("/inference/v1/generate", json={"token_ids": PROMPT, **body})


def chunks(text: str) -> list[Any]:
    """A stream's events (``[DONE]`` as the string)."""
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [event if event == "[DONE]" else orjson.loads(event) for event in events]


def mocker_tokens(count: int) -> list[int]:
    engine = MockerEngine.from_tokenizer(TOKENIZER)
    from operators.contracts.llm import PreprocessedRequest

    request = PreprocessedRequest(token_ids=list(PROMPT))
    return [engine.token_at(request, position) for position in range(count)]


# -- the shapes -------------------------------------------------------------------------------


async def test_a_whole_answer_is_vllms_generate_response() -> None:
    answer = await generate(
        app_of(),
        sampling_params={"max_tokens": 5, "ignore_eos": True, "logprobs": 2},
        request_id="r-1",
        return_token_ids=True,
    )
    assert answer.status_code == 200
    body = answer.json()
    assert (body["request_id"], body["model"], body["output_mode"]) == ("r-1", "m", "tokens")
    assert body["prompt_token_ids"] == PROMPT
    [choice] = body["choices"]
    assert choice["token_ids"] == mocker_tokens(5)
    assert (choice["index"], choice["finish_reason"], choice["stop_reason"]) == (0, "length", None)
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == choice["token_ids"]
    for entry in content:  # the sampled token first, then the others, k in all
        assert entry["top_logprobs"][0] == {
            "token_id": entry["token_id"],
            "logprob": entry["logprob"],
        }
        assert len(entry["top_logprobs"]) == 2
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 5


async def test_a_stream_is_one_chunk_per_output_then_the_usage_then_done() -> None:
    answer = await generate(
        app_of(),
        sampling_params={"max_tokens": 4, "ignore_eos": True, "n": 2},
        stream=True,
        stream_options={"include_usage": True},
    )
    events = chunks(answer.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 8
    by_choice: dict[int, list[int]] = {}
    for event in events[:-2]:
        [choice] = event["choices"]
        by_choice.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert by_choice == {0: mocker_tokens(4), 1: mocker_tokens(4)}
    assert "usage" not in chunks((await generate(app_of(), stream=True)).text)[-2]


async def test_cached_prompt_tokens_are_reported_on_the_second_request() -> None:
    app = app_of()
    await generate(app, sampling_params={"max_tokens": 1})
    body = (await generate(app, sampling_params={"max_tokens": 1})).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) // 16 * 16


async def test_the_stop_rules_work_on_ids_and_text() -> None:
    app = app_of()
    tokens = mocker_tokens(6)
    body = (await generate(app, sampling_params={"stop_token_ids": [tokens[2]]})).json()
    [choice] = body["choices"]
    assert choice["token_ids"] == tokens[:3]  # every id generated, the stop's included
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", tokens[2])
    held = {"stop_token_ids": [tokens[1]], "min_tokens": 4, "max_tokens": 4}
    body = (await generate(app, sampling_params=held)).json()
    assert body["choices"][0]["token_ids"] == tokens[:4]  # no stop before min_tokens
    stop = TOKENIZER.decode(tokens[3:5])
    body = (await generate(app, sampling_params={"stop": [stop], "max_tokens": 8})).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == stop


async def test_a_lost_worker_is_migrated_and_the_ids_are_the_same() -> None:
    workers = WorkerSet(
        "decode",
        {
            "a": MockerEngine.from_tokenizer(TOKENIZER, fail_after_tokens=2),
            "b": MockerEngine.from_tokenizer(TOKENIZER),
        },
    )
    app = app_of(Router(workers))
    body = (await generate(app, sampling_params={"max_tokens": 6, "ignore_eos": True})).json()
    assert body["choices"][0]["token_ids"] == mocker_tokens(6)
    assert "llm_pipeline_migrations_total" in app.metrics.render().decode()


# -- refusals, by name -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {"logit_bias": {"1": 1}}}, "sampling_params.logit_bias"),
        ({"sampling_params": {"prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
        ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"sampling_params": {"max_tokens": 10_000}}, "sampling_params.max_tokens"),
        ({"sampling_params": {"min_tokens": 5, "max_tokens": 2}}, "sampling_params.min_tokens"),
        (
            {"sampling_params": {"structured_outputs": {"regex": "a+"}}},
            "sampling_params.structured_outputs.regex",
        ),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids.1"),
        ({"token_ids": [1, 10**6]}, "token_ids.1"),
        ({"token_ids": [1] * CONTEXT}, "token_ids"),
        ({"output_mode": "text"}, "output_mode"),
        ({"cache_salt": "s"}, "cache_salt"),
        ({"features": {"mm_hashes": {}}}, "features"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
async def test_what_it_cannot_honour_is_a_400_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    answer = await generate(app_of(), **body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, 400)


async def test_a_constrained_request_on_an_engine_without_it_is_refused_by_name() -> None:
    answer = await generate(
        app_of(), sampling_params={"structured_outputs": {"json": {"type": "object"}}}
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "sampling_params.structured_outputs"


async def test_it_is_behind_the_api_key_and_routed_by_model() -> None:
    app = app_of(guard=Guard(api_keys={"secret": 0}))
    async with client(app) as http:
        denied = await http.post("/inference/v1/generate", json={"token_ids": PROMPT})
        assert denied.status_code == 401
        headers = {"authorization": "Bearer secret"}
        unknown = await http.post(
            "/inference/v1/generate", json={"token_ids": PROMPT, "model": "x"}, headers=headers
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "model"
        served = await http.post(
            "/inference/v1/generate",
            json={"token_ids": PROMPT, "model": "m", "sampling_params": {"max_tokens": 2}},
            headers=headers,
        )
        assert served.status_code == 200
        metrics = app.metrics.render().decode()
    assert 'endpoint="/inference/v1/generate"' in metrics


async def test_admission_and_deadlines_are_the_apps() -> None:
    engine = ScriptedEngine([EngineOutput([PROMPT[0]])], then="hang")
    app = app_of(engine, guard=Guard(max_inflight=1, request_timeout=0.5))
    async with client(app) as http, anyio.create_task_group() as tg:
        first: list[httpx.Response] = []

        async def hold() -> None:
            first.append(await http.post("/inference/v1/generate", json={"token_ids": PROMPT}))

        tg.start_soon(hold)
        await engine.hanging.wait()
        refused = await http.post("/inference/v1/generate", json={"token_ids": PROMPT})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == 503
    [timed_out] = first  # the held one reached its deadline: killed, a 504
    assert timed_out.status_code == 504
    assert timed_out.json()["error"]["code"] == 504
