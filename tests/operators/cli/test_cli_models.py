"""``llm-pipeline serve --models FILE``: several models behind one server, each with its own
graph, driven as a user would (the official ``openai`` and ``anthropic`` clients against a
real ``serve`` process).

Two echo models render their prompts with different chat templates, so each answer says
which model's graph it went through.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.helpers.server_process import ServerProcess, run_cli

pytestmark = pytest.mark.slow

HI: Any = [{"role": "user", "content": "hi"}]
MODELS = """
[[model]]
name = "alpha"
engine = "echo"
chat-template = "alpha.jinja"

[[model]]
name = "beta"
engine = "echo"
chat-template = "beta.jinja"
echo-delay-ms = 1
"""


@pytest.fixture(scope="module")
def models_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    (folder / "alpha.jinja").write_text("alpha<{% for m in messages %}{{ m.content }}{% endfor %}>")
    (folder / "beta.jinja").write_text("beta<{% for m in messages %}{{ m.content }}{% endfor %}>")
    path = folder / "models.toml"
    path.write_text(MODELS)
    return path


@pytest.fixture(scope="module")
def server(models_file: Path) -> Iterator[ServerProcess]:
    process = ServerProcess("--models", str(models_file))
    yield process
    process.stop()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=10)


async def test_each_model_answers_through_its_own_chat_template(server: ServerProcess) -> None:
    async with client(server) as api:
        alpha = await api.chat.completions.create(model="alpha", messages=HI)
        beta = await api.chat.completions.create(model="beta", messages=HI)
        stream = await api.chat.completions.create(model="alpha", messages=HI, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        listed = await api.models.list()
    assert alpha.choices[0].message.content == "alpha<hi>"
    assert beta.choices[0].message.content == "beta<hi>"
    assert (alpha.model, beta.model) == ("alpha", "beta")
    assert streamed == "alpha<hi>"
    assert [model.id for model in listed.data] == ["alpha", "beta"]
    assert server.model == "alpha"  # the banner names the first (and the others after it)


async def test_an_unknown_model_is_a_404_in_each_apis_words(server: ServerProcess) -> None:
    async with client(server) as api:
        with pytest.raises(openai.NotFoundError) as chat:
            await api.chat.completions.create(model="gamma", messages=HI)
        with pytest.raises(openai.NotFoundError) as response:
            await api.responses.create(model="gamma", input="hi")
    for refused in (chat, response):
        body: Any = refused.value.body
        assert (body["param"], body["code"]) == ("model", "model_not_found")
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="x", max_retries=0, timeout=10
    ) as claude:
        with pytest.raises(anthropic.NotFoundError) as message:
            await claude.messages.create(model="gamma", max_tokens=5, messages=HI)
        answered = await claude.messages.create(model="beta", max_tokens=50, messages=HI)
    assert message.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert answered.content[0].text == "beta<hi>"  # type: ignore[union-attr]


async def test_metrics_count_each_model_apart(server: ServerProcess) -> None:
    async with client(server) as api:
        await api.chat.completions.create(model="beta", messages=HI, max_tokens=3)
    async with httpx.AsyncClient(timeout=5) as http:
        metrics = (await http.get(f"{server.url}/metrics")).text
    assert 'llm_pipeline_output_tokens_total{model="beta"}' in metrics
    assert 'endpoint="/v1/chat/completions",model="beta",status="200"' in metrics


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("[[model]]\nengine = 'echo'\n", "needs a name"),
        ("[[model]]\nname = 'a'\n[[model]]\nname = 'a'\n", "given twice"),
        ("[[model]]\nname = 'a'\nno-such-option = 1\n", "unknown option 'no-such-option'"),
        ("[[model]]\nname = 'a'\nport = 9\n", "option of the whole server"),
        ("[[model]]\nname = 'a'\nparallel = 0\n", "--parallel"),
        ("[[model]]\nname = 'a'\nengine = 'nope'\n", "--engine"),
        ("[[model]]\nname = 'a'\necho-cycle = 'yes'\n", "true or false"),
        ("name = 'a'\n", "unknown top-level key"),
        ("[[model]\n", "not valid TOML"),
        ("", "found none"),
    ],
)
def test_a_wrong_models_file_is_one_line_naming_what(
    tmp_path: Path, content: str, said: str
) -> None:
    path = tmp_path / "models.toml"
    path.write_text(content)
    result = run_cli(["serve", "--port", "0", "--models", str(path)])
    assert result.returncode == 2
    assert said in result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_models_and_model_name_do_not_go_together(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text("[[model]]\nname = 'a'\n")
    result = run_cli(["serve", "--models", str(path), "--model-name", "b"])
    assert result.returncode == 2
    assert "--model-name" in result.stderr
    missing = run_cli(["serve", "--models", str(tmp_path / "absent.toml")])
    assert missing.returncode == 2
    assert "cannot read it" in missing.stderr
