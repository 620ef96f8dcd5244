"""Anthropic's Messages API of a real ``llm-pipeline serve``, driven by the official
``anthropic`` SDK (and raw HTTP where the SDK would not send what is being tested).

The echo engine answers with its prompt and ``--chat-template`` renders each message as
``[role]content``, so an answer shows which turns reached the model, in which order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import pytest

from tests.helpers.server_process import ServerProcess

JSON = {"content-type": "application/json"}

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PARIS = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
USER: Any = [{"role": "user", "content": "Hello there"}]


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


def client(server: ServerProcess, key: str = "x", **options: Any) -> anthropic.AsyncAnthropic:
    options.setdefault("timeout", 10)
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=key, max_retries=0, **options)


@pytest.fixture
async def api(server: ServerProcess) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with client(server) as sdk:
        yield sdk


async def test_a_message_is_answered_in_anthropics_shape(api: anthropic.AsyncAnthropic) -> None:
    message = await api.messages.create(
        model="echo", max_tokens=100, system="Be nice", messages=USER
    )
    assert message.id.startswith("msg_")
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == "echo"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "[system]Be nice[user]Hello there"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens > 0
    assert usage.cache_read_input_tokens == 0
    assert usage.output_tokens == usage.input_tokens  # the echo says its whole prompt
    count = await api.messages.count_tokens(model="echo", system="Be nice", messages=USER)
    assert count.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


async def test_turns_blocks_and_tools_reach_the_model_in_order(
    api: anthropic.AsyncAnthropic,
) -> None:
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"c": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    system: Any = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    message = await api.messages.create(
        model="echo", max_tokens=100, system=system, messages=messages, tools=[WEATHER]
    )
    assert message.content[0].text == (  # type: ignore[union-attr]
        "[system]A\nB[user]Weather?[assistant]Let me look.[tool]sunny[user]Thanks"
    )
    count = await api.messages.count_tokens(
        model="echo", system=system, messages=messages, tools=[WEATHER]
    )
    assert count.input_tokens == message.usage.input_tokens


async def test_a_stream_assembles_to_the_message(api: anthropic.AsyncAnthropic) -> None:
    whole = await api.messages.create(model="echo", max_tokens=100, messages=USER)
    async with api.messages.stream(model="echo", max_tokens=100, messages=USER) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


async def test_a_raw_stream_has_anthropics_events_and_a_ping(server: ServerProcess) -> None:
    body = {"model": "echo", "max_tokens": 5, "messages": USER, "stream": True}
    headers = {"x-api-key": "x", "anthropic-version": "2023-06-01"}
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=10) as http,
        http.stream("POST", "/v1/messages", json=body, headers=headers) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    names = [
        line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event:")
    ]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert '"stop_reason":"max_tokens"' in text


async def test_stop_sequences_end_the_answer_and_say_which(api: anthropic.AsyncAnthropic) -> None:
    message = await api.messages.create(
        model="echo",
        max_tokens=100,
        messages=[{"role": "user", "content": "one two END three"}],
        stop_sequences=["nope", "END"],
    )
    assert message.content[0].text == "[user]one two "  # type: ignore[union-attr]
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "END"
    cut = await api.messages.create(model="echo", max_tokens=3, messages=USER)
    assert cut.stop_reason == "max_tokens"
    assert cut.usage.output_tokens == 3


async def test_a_tool_call_is_a_tool_use_block(api: anthropic.AsyncAnthropic) -> None:
    messages: Any = [{"role": "user", "content": f"Look: {PARIS}"}]
    message = await api.messages.create(
        model="echo", max_tokens=200, messages=messages, tools=[WEATHER]
    )
    assert [block.type for block in message.content] == ["text", "tool_use"]
    call = message.content[1]
    assert call.type == "tool_use"
    assert call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use"
    async with api.messages.stream(
        model="echo", max_tokens=200, messages=messages, tools=[WEATHER]
    ) as stream:
        final = await stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        ("text", None),
        ("tool_use", {"city": "Paris"}),
    ]


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 2**31, "messages": USER}, "max_tokens"),
        ({"max_tokens": 5, "messages": USER, "extra_body": {"temperature": 1.5}}, "temperature"),
        ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled"}}, "thinking"),
        ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305"}]}, "tools"),
        (
            {"max_tokens": 5, "messages": [*USER, {"role": "assistant", "content": "Sure"}]},
            "messages",
        ),
        ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ],
)
async def test_a_bad_request_is_an_anthropic_400_naming_the_field(
    api: anthropic.AsyncAnthropic, body: dict[str, Any], mentions: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        await api.messages.create(model="echo", **body)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert mentions in error["error"]["message"]


async def test_no_max_tokens_bad_json_an_unknown_model_a_bad_version_are_refused(
    server: ServerProcess,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        missing = await http.post("/v1/messages", json={"model": "echo", "messages": USER})
        assert missing.status_code == 400  # max_tokens is required, as Anthropic requires it
        assert missing.json()["error"] == {
            "type": "invalid_request_error",
            "message": "Missing required parameter: 'max_tokens'",
        }
        bad = await http.post("/v1/messages", content=b"{nope", headers=JSON)
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error"
        unknown = await http.post(
            "/v1/messages", json={"model": "claude", "max_tokens": 5, "messages": USER}
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["type"] == "not_found_error"
        version = await http.post(
            "/v1/messages",
            json={"model": "echo", "max_tokens": 5, "messages": USER},
            headers={"anthropic-version": "yesterday"},
        )
        assert version.status_code == 400
        assert "anthropic-version" in version.json()["error"]["message"]


async def test_keys_are_checked_as_x_api_key_and_as_bearer(template: Path) -> None:
    server = ServerProcess("--chat-template", str(template), "--api-key", "sk-1")
    try:
        async with client(server, "wrong") as wrong:
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await wrong.messages.create(model="echo", max_tokens=5, messages=USER)
        assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        async with client(server, "sk-1") as right:  # the SDK sends x-api-key
            assert (await right.messages.create(model="echo", max_tokens=2, messages=USER)).id
        async with anthropic.AsyncAnthropic(
            base_url=server.url, auth_token="sk-1", max_retries=0, timeout=10
        ) as bearer:
            assert (await bearer.messages.create(model="echo", max_tokens=2, messages=USER)).id
    finally:
        server.stop()


async def test_max_inflight_is_a_529_and_a_deadline_a_504(template: Path) -> None:
    server = ServerProcess(
        "--chat-template",
        str(template),
        "--echo-delay-ms",
        "200",
        "--max-inflight",
        "1",
        "--request-timeout",
        "1",
    )
    try:
        async with client(server) as api:
            started = anyio.Event()
            ended: list[anthropic.APIStatusError] = []

            async def hold() -> None:
                try:
                    async with api.messages.stream(
                        model="echo", max_tokens=100, messages=USER
                    ) as stream:
                        async for _ in stream:
                            started.set()
                except anthropic.APIStatusError as exc:  # its deadline: an error event
                    ended.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await started.wait()
                with pytest.raises(anthropic.OverloadedError) as overloaded:
                    await api.messages.create(model="echo", max_tokens=5, messages=USER)
                assert overloaded.value.status_code == 529
                assert overloaded.value.response.headers["retry-after"] == "1"
            [timed_out] = ended
            assert "timeout_error" in str(timed_out.body)
            with pytest.raises(anthropic.InternalServerError) as deadline:
                await api.messages.create(model="echo", max_tokens=100, messages=USER)
            assert deadline.value.status_code == 504
            assert deadline.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]
    finally:
        server.stop()


async def test_cached_prompt_tokens_are_cache_read_input_tokens() -> None:
    server = ServerProcess(
        "--engine", "mocker", "--mocker-cache-blocks", "256", "--mocker-decode-ms-per-step", "0.2"
    )
    try:
        async with client(server) as api:
            long = [{"role": "user", "content": " ".join(["word"] * 200)}]
            first = await api.messages.create(model="mocker", max_tokens=2, messages=long)
            second = await api.messages.create(model="mocker", max_tokens=2, messages=long)
            count = await api.messages.count_tokens(model="mocker", messages=long)
    finally:
        server.stop()
    assert first.usage.cache_read_input_tokens == 0
    assert (second.usage.cache_read_input_tokens or 0) > 0
    for message in (first, second):
        cached = message.usage.cache_read_input_tokens or 0
        assert message.usage.input_tokens + cached == count.input_tokens
