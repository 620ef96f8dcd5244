"""Testing what you build with pytest: an operator, an engine and the HTTP server.

Each kind of test uses what ``pipeline.testing`` and ``operators.testing`` ship: a scripted
engine and ``check_operator`` for an operator, ``check_engine`` for an engine, and
``openai_client`` (the official client, talking to the app in-process, no socket) for the
server. pytest runs ``async def`` tests with pytest-asyncio in auto mode; put this in your
``pyproject.toml``::

    [tool.pytest.ini_options]
    asyncio_mode = "auto"

Run it: ``python examples/test_with_pytest.py`` (or ``pytest examples/test_with_pytest.py``).
"""

from __future__ import annotations

import subprocess
import sys

import anyio

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.testing import check_engine, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, Stream, link
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context


class Upper:
    """An operator: upper-cases every output on its way back."""

    async def generate(self, ctx: Context[str], downstream: Engine[str, str]) -> Stream[str]:
        async for item in downstream.generate(ctx):
            yield item.upper()


async def test_the_operator() -> None:
    engine = ScriptedEngine(["a", "b"])
    assert await collect(link(Upper(), engine), make_context("req")) == ["A", "B"]
    await check_operator(Upper, "req", ["a", "b", "c"])  # the operator contract


async def test_the_engine() -> None:
    await check_engine(lambda: EchoEngine(cycle=True))  # the engine contract


async def test_the_server() -> None:
    tokenizer = Tokenizer.default()
    app = build_app(EchoEngine.from_tokenizer(tokenizer), tokenizer, model_name="echo")
    with anyio.fail_after(10):  # an async test never waits forever
        async with openai_client(app) as client:
            reply = await client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "Hi there"}], max_tokens=2
            )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 2


if __name__ == "__main__":  # the same as `pytest examples/test_with_pytest.py`
    raise SystemExit(
        subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__])
    )
