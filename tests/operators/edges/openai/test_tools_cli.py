"""``llm-pipeline serve --chat-template FILE --tool-call-parser MODULE:NAME --reasoning-parser
think`` as a subprocess, driven by the official client: the options a user of their own
model's format starts the server with."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

FORMAT_MODULE = """
from operators.parsers import MarkerToolFormat

FUNCTIONCALL = MarkerToolFormat(start="<functioncall>", end="</functioncall>")
"""
TOOLS: list = [{"type": "function", "function": {"name": "get_time"}}]  # type: ignore[type-arg]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("user")
    (folder / "my_formats.py").write_text(FORMAT_MODULE)
    template = folder / "last_message.jinja"
    template.write_text("{{ messages[-1]['content'] }}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(folder))
        server = ServerProcess(
            "--engine", "echo",
            "--chat-template", str(template),
            "--tool-call-parser", "my_formats:FUNCTIONCALL",
            "--reasoning-parser", "think",
        )  # fmt: skip
    yield server
    server.stop()


async def test_the_users_template_format_and_reasoning_are_served(server: ServerProcess) -> None:
    said = '<think>needs the time</think>Sure. <functioncall>{"name": "get_time"}</functioncall>'
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as api:
        reply = await api.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": said}], tools=TOOLS
        )
    [choice] = reply.choices
    assert choice.message.content == "Sure. "
    assert getattr(choice.message, "reasoning_content", None) == "needs the time"
    [call] = choice.message.tool_calls or []
    assert call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments or "{}")) == ("get_time", {})
    assert choice.finish_reason == "tool_calls"


async def test_a_constrained_request_to_the_echo_engine_is_a_400(server: ServerProcess) -> None:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_object"},
            )
    body: dict = caught.value.body  # type: ignore[assignment, type-arg]
    assert body["param"] == "response_format"
