"""The Responses API of a real ``llm-pipeline serve``, driven by the official ``openai`` SDK.

The echo engine answers with its prompt, and ``--chat-template`` renders each message as
``[role]content``: so an answer shows exactly which messages reached the model, in which
order, which is what stored conversations, instructions, function calls and their outputs
are about.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.server_process import ServerProcess

JSON = {"content-type": "application/json"}

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PARIS = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "roles.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(template: Path) -> Iterator[ServerProcess]:
    process = ServerProcess("--chat-template", str(template))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def keyed(template: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        "--chat-template", str(template), "--api-key", "key-a", "--api-key", "key-b"
    )
    yield process
    process.stop()


@pytest.fixture
async def api(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="x", max_retries=0, timeout=10
    ) as client:
        yield client


async def test_the_input_and_instructions_reach_the_model(api: openai.AsyncOpenAI) -> None:
    response = await api.responses.create(model="echo", input="Hello", instructions="Be brief")
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status == "completed"
    assert response.output_text == "[system]Be brief[user]Hello"
    [message] = response.output
    assert message.type == "message"
    assert message.id.startswith("msg_")
    assert message.role == "assistant"
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens == usage.output_tokens > 0  # the echo says its prompt
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == "Be brief"
    assert response.previous_response_id is None


async def test_previous_response_id_continues_a_conversation_at_any_depth(
    api: openai.AsyncOpenAI,
) -> None:
    said = ""  # what the model saw last time, plus its answer
    previous = None
    for turn in range(5):
        response = await api.responses.create(
            model="echo",
            input=[{"role": "user", "content": f"turn {turn}"}],
            instructions=f"only for turn {turn}",  # never carried over
            previous_response_id=previous,
        )
        assert response.previous_response_id == previous
        history = said
        assert response.output_text == f"[system]only for turn {turn}{history}[user]turn {turn}"
        said = f"{history}[user]turn {turn}[assistant]{response.output_text}"
        previous = response.id
    items = [item async for item in api.responses.input_items.list(previous, order="asc")]
    assert [(item.type, item.role) for item in items] == [  # type: ignore[union-attr]
        ("message", role) for _ in range(4) for role in ("user", "assistant")
    ] + [("message", "user")]


async def test_function_calls_and_their_outputs_stay_in_the_conversation(
    api: openai.AsyncOpenAI,
) -> None:
    first = await api.responses.create(model="echo", input=f"Weather? {PARIS}", tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Paris"}')]
    call_id = calls[0].call_id
    assert first.output[0].type == "message"  # the text before the call
    second = await api.responses.create(
        model="echo",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER],
    )
    # the call (an assistant turn with its text) and its output reached the model
    assert second.output_text.endswith("[assistant][user]Weather? [tool]sunny, 21 C")
    items = [item async for item in api.responses.input_items.list(second.id, order="asc")]
    kinds = [item.type for item in items]
    assert kinds == ["message", "message", "function_call", "function_call_output"]
    assert items[2].call_id == call_id  # type: ignore[union-attr]


async def test_a_stored_response_is_retrieved_listed_and_deleted(api: openai.AsyncOpenAI) -> None:
    created = await api.responses.create(model="echo", input="keep me", metadata={"k": "v"})
    got = await api.responses.retrieve(created.id)
    assert got.model_dump(exclude={"completed_at"}) == created.model_dump(exclude={"completed_at"})
    assert got.metadata == {"k": "v"}
    page = await api.responses.input_items.list(created.id)
    assert [item.type for item in page.data] == ["message"]
    assert page.data[0].content[0].text == "keep me"  # type: ignore[union-attr]
    await api.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await api.responses.retrieve(created.id)
    assert missing.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as gone:
        await api.responses.create(model="echo", input="more", previous_response_id=created.id)
    assert gone.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await api.responses.delete(created.id)


async def test_input_items_are_paginated_newest_first(api: openai.AsyncOpenAI) -> None:
    items: list[Any] = [{"role": "user", "content": f"m{k}"} for k in range(7)]
    created = await api.responses.create(model="echo", input=items, max_output_tokens=1)
    page = await api.responses.input_items.list(created.id, limit=3)
    assert [item.content[0].text for item in page.data] == ["m6", "m5", "m4"]  # type: ignore[union-attr]
    assert page.has_more
    every = [item async for item in api.responses.input_items.list(created.id, limit=2)]
    assert [item.content[0].text for item in every] == [f"m{k}" for k in range(6, -1, -1)]  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as bad:
        await api.responses.input_items.list(created.id, limit=101)
    assert bad.value.body["param"] == "limit"  # type: ignore[index]


async def test_store_false_keeps_nothing(api: openai.AsyncOpenAI) -> None:
    response = await api.responses.create(model="echo", input="forget me", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(response.id)


async def test_max_output_tokens_makes_the_response_incomplete(api: openai.AsyncOpenAI) -> None:
    response = await api.responses.create(model="echo", input="a long prompt", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == 2
    stream = await api.responses.create(
        model="echo", input="a long prompt", max_output_tokens=2, stream=True
    )
    names = [event.type async for event in stream]
    assert names[-1] == "response.incomplete"


async def test_a_stream_has_every_event_in_order_and_equals_the_stored_response(
    api: openai.AsyncOpenAI,
) -> None:
    async with api.responses.stream(model="echo", input="Stream me please") as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    names = [event.type for event in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert final.output_text == "[user]Stream me please"
    stored = await api.responses.retrieve(final.id)
    assert stored.model_dump(exclude={"completed_at"}) == final.model_dump(
        exclude={"completed_at", "output"}
    ) | {"output": stored.model_dump()["output"]}
    assert stored.output_text == final.output_text


async def test_stop_strings_and_logprobs_work_through_the_edge(api: openai.AsyncOpenAI) -> None:
    response = await api.responses.create(
        model="echo",
        input="one two STOP three",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        extra_body={"stop": ["STOP"]},
    )
    assert response.output_text == "[user]one two "
    [message] = response.output
    [part] = message.content  # type: ignore[union-attr]
    assert part.logprobs is not None
    # a token is in the logprobs once its text (or part of it: " ST") was shown
    assert "".join(entry.token for entry in part.logprobs) == "[user]one two ST"
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0"),  # the item that is a built-in tool
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # echo: no reasoning
        ({"reasoning": {"mode": "pro"}}, "reasoning.mode"),
        ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"truncation": "middle"}, "truncation"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"max_output_tokens": 2**31}, "max_output_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include.0"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),  # echo: no grammar
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    api: openai.AsyncOpenAI, request_fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "echo", "input": "hi"} | request_fields
    with pytest.raises(openai.BadRequestError) as refused:
        await api.responses.create(**body)
    error: Any = refused.value.body
    assert error["param"] == param
    # the message names the field as this API does, never as the chat request it became
    for chat_name in ("response_format", "reasoning_effort", "max_tokens", "messages"):
        assert f"'{chat_name}'" not in error["message"]
    if param == "text.format":
        assert "'text.format' needs constrained decoding" in error["message"]


async def test_a_malformed_body_and_an_unknown_model_are_refused(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        bad = await http.post("/v1/responses", content=b"{not json", headers=JSON)
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error"
        unknown = await http.post("/v1/responses", json={"model": "nope", "input": "hi"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "model"
        wrong_method = await http.put("/v1/responses/resp_1")
        assert wrong_method.status_code == 405
        assert set(wrong_method.headers["allow"].split(", ")) == {"DELETE", "GET"}


async def test_stored_responses_belong_to_the_key_that_made_them(keyed: ServerProcess) -> None:
    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=keyed.base_url, api_key=key, max_retries=0, timeout=10)

    async with client("key-a") as a, client("key-b") as b, client("wrong") as nobody:
        mine = await a.responses.create(model="echo", input="secret")
        for call in (
            lambda: b.responses.retrieve(mine.id),
            lambda: b.responses.input_items.list(mine.id),
            lambda: b.responses.delete(mine.id),
            lambda: b.responses.create(model="echo", input="x", previous_response_id=mine.id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call()
        with pytest.raises(openai.AuthenticationError):
            await nobody.responses.retrieve(mine.id)
        assert (await a.responses.retrieve(mine.id)).output_text == "[user]secret"
        follow = await a.responses.create(model="echo", input="more", previous_response_id=mine.id)
        assert follow.output_text == "[user]secret[assistant][user]secret[user]more"
