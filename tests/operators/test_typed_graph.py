"""Graphs are typed end to end: mypy accepts a well-ordered graph and rejects a mis-ordered one.

One mypy run checks every snippet below (a cold run takes a few seconds). A snippet line
ending in ``# error`` must get a mypy error, and no other line may: so a check that stopped
catching a mis-order fails, and so does one that started rejecting a correct graph.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """\
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, assert_type

from operators.backend import Backend
from operators.graph import default_graph
from operators.contracts.llm import BackendOutput, EngineOutput, PreprocessedRequest
from operators.migration import Migration
from operators.edges.openai.events import OpenAIEvent
from operators.edges.openai.preprocessor import OpenAIRequest
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, Operator, Stream, chain, link

PR = PreprocessedRequest


class Redact:
    \"\"\"Rewrites text: it belongs between Migration and the Backend.\"\"\"

    async def generate(
        self, ctx: Context[PR], downstream: Engine[PR, BackendOutput], /
    ) -> Stream[BackendOutput]:
        async with aclosing(downstream.generate(ctx)) as stream:
            async for output in stream:
                yield output


class Tap:
    \"\"\"Sees engine outputs: it belongs below the Backend.\"\"\"

    async def generate(
        self, ctx: Context[PR], downstream: Engine[PR, EngineOutput], /
    ) -> Stream[EngineOutput]:
        async for output in downstream.generate(ctx):
            yield output


class IteratorEngine:
    \"\"\"Returns an AsyncIterator, which promises no aclose(): not an Engine.\"\"\"

    async def generate(self, ctx: Context[PR], /) -> AsyncIterator[EngineOutput]:
        yield EngineOutput(token_ids=[1])
"""

GOOD = """\
def graphs(engine: Engine[PR, EngineOutput], tok: Tokenizer) -> None:
    assert_type(default_graph(engine, tok, model_name="m"), Engine[OpenAIRequest, OpenAIEvent])
    g = link(Migration(), Redact(), Backend(tok), Tap(), engine)
    assert_type(g, Engine[PR, BackendOutput])
    redactions: list[Operator[PR, BackendOutput, PR, BackendOutput]] = [Redact(), Redact()]
    taps = [Tap()]
    g2 = link(Migration(), chain(*redactions), Backend(tok), chain(*taps), engine)
    assert_type(g2, Engine[PR, BackendOutput])
    six = link(Tap(), Tap(), Tap(), Tap(), Tap(), Tap(), engine)
    eleven = link(Tap(), Tap(), Tap(), Tap(), Tap(), six)
    assert_type(eleven, Engine[PR, EngineOutput])


async def drive(engine: Engine[PR, EngineOutput], ctx: Context[PR]) -> None:
    async with aclosing(engine.generate(ctx)) as stream:
        async for output in stream:
            assert_type(output, EngineOutput)
"""

BAD = """\
def graphs(engine: Engine[PR, EngineOutput], tok: Tokenizer) -> None:
    link(Migration(), Backend(tok), Redact(), engine)  # error
    link(Backend(tok), Migration(), engine)  # error
    link(Migration(), Tap(), Backend(tok), engine)  # error
    link(Migration(), Backend(tok), chain(Redact()), engine)  # error
    link(engine, Backend(tok))  # error
    link(Backend(tok), IteratorEngine())  # error
    chain(Redact(), Tap())  # error
    link(*[Tap(), Tap()], engine)  # error  (a list's length is unknown: link(chain(*taps), e))
"""


def _marked_lines(source: str) -> set[int]:
    return {n for n, line in enumerate(source.splitlines(), 1) if "  # error" in line}


def test_mypy_accepts_well_ordered_graphs_and_rejects_mis_ordered_ones(tmp_path: Path) -> None:
    snippets = {"good_graph.py": PRELUDE + GOOD, "bad_graph.py": PRELUDE + BAD}
    for name, source in snippets.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    # The worktree's packages, not whatever an editable install points at.
    config = tmp_path / "mypy.ini"
    config.write_text(
        f"[mypy]\nmypy_path = {ROOT}\nstrict = True\nwarn_unused_configs = False\n"
        "[mypy-tokenizers.*,gguf.*,uvicorn.*,prometheus_client.*,msgpack.*,llama_cpp.*]\n"
        "ignore_missing_imports = True\n"
    )
    stdout, stderr, status = mypy_api.run(
        [
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--follow-imports",
            "silent",  # the project's own modules are checked by the lint step
            "--no-error-summary",
            *(str(tmp_path / name) for name in snippets),
        ]
    )
    assert status in (0, 1), f"mypy did not run: {stderr}{stdout}"
    errors: dict[str, set[int]] = {name: set() for name in snippets}
    for match in re.finditer(r"^(?:.*/)?(\w+\.py):(\d+): error: (.*)$", stdout, re.M):
        errors[match[1]].add(int(match[2]))
    assert errors["good_graph.py"] == set(), stdout
    assert errors["bad_graph.py"] == _marked_lines(PRELUDE + BAD), stdout
