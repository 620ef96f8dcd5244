"""The default graph as a value: named stages, operators inserted at named points, served
over HTTP (``build_app(before=...)``) exactly like the default graph."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from operators.backend import Backend
from operators.contracts.llm import BackendOutput, EngineOutput, PreprocessedRequest
from operators.contracts.rewriting import rewritten
from operators.edges.openai.events import (
    ChoiceDelta,
    ChoiceStart,
    OpenAIEvent,
    ResponseHead,
    Usage,
)
from operators.edges.openai.preprocessor import OpenAIPreprocessor, OpenAIRequest
from operators.engines import EchoEngine
from operators.graph import POINTS, STAGES, Stages, default_graph, default_stages
from operators.migration import Migration
from operators.parsers import OutputParsers
from operators.placement import fits
from operators.routing.encoder_router import EncoderRouter
from operators.routing.prefill_router import PrefillRouter
from operators.serving import build_app
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, LinkError, Stream

if TYPE_CHECKING:
    from operators.contracts.llm import Tool

TOKENIZER = Tokenizer.default()
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "one two three four"


class Recorder:
    """A passthrough that records every request it is asked for and every item it passes."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.requests: list[Any] = []
        self.outputs: list[Any] = []

    async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any]) -> AsyncIterator[Any]:
        self.requests.append(ctx.data)
        async for item in downstream.generate(ctx):
            self.outputs.append(item)
            yield item

    def __repr__(self) -> str:
        return f"Recorder({self.label!r})"


def labels(stages: Stages) -> list[str]:
    return [op.label if isinstance(op, Recorder) else type(op).__name__ for op in stages]


def test_the_default_stages_are_named_and_in_order() -> None:
    stages = default_stages(TOKENIZER, model_name="m")
    assert STAGES == (
        "preprocessor",
        "parser",
        "migration",
        "backend",
        "encoder_router",
        "prefill_router",
    )
    assert POINTS == (*STAGES, "engine")
    assert [type(getattr(stages, name)) for name in STAGES] == [
        OpenAIPreprocessor,
        OutputParsers,
        Migration,
        Backend,
        EncoderRouter,
        PrefillRouter,
    ]
    assert list(stages) == [getattr(stages, name) for name in STAGES]


def test_insertions_go_at_their_point_and_leave_the_original_as_it_was() -> None:
    stages = default_stages(TOKENIZER, model_name="m")
    spliced = (
        stages.insert_before("backend", Recorder("b1"))
        .insert_before("backend", Recorder("b2"))  # after b1, still just before the Backend
        .insert_after("migration", Recorder("a1"))  # just after Migration, so before b1
        .insert_before("preprocessor", Recorder("front"))
        .insert_before("engine", Recorder("last"))
    )
    assert labels(spliced) == [
        "front",
        "OpenAIPreprocessor",
        "OutputParsers",
        "Migration",
        "a1",
        "b1",
        "b2",
        "Backend",
        "EncoderRouter",
        "PrefillRouter",
        "last",
    ]
    assert labels(stages) == [
        "OpenAIPreprocessor",
        "OutputParsers",
        "Migration",
        "Backend",
        "EncoderRouter",
        "PrefillRouter",
    ]
    assert labels(stages.insert({"engine": [Recorder("e")], "migration": [Recorder("m")]})) == [
        "OpenAIPreprocessor",
        "OutputParsers",
        "m",
        "Migration",
        "Backend",
        "EncoderRouter",
        "PrefillRouter",
        "e",
    ]


@pytest.mark.parametrize(
    ("splice", "valid"),
    [
        (lambda s: s.insert_before("detokenizer", Recorder()), POINTS),
        (lambda s: s.insert_after("engine", Recorder()), STAGES),
        (lambda s: s.insert({"Backend": [Recorder()]}), POINTS),
    ],
)
def test_an_unknown_stage_is_an_error_naming_the_valid_ones(
    splice: Any, valid: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match="default graph's points") as caught:
        splice(default_stages(TOKENIZER, model_name="m"))
    assert all(repr(name) in str(caught.value) for name in valid)


def test_default_graph_and_build_app_refuse_an_unknown_stage() -> None:
    engine = EchoEngine.from_tokenizer(TOKENIZER)
    with pytest.raises(ValueError, match="'prefill_router', 'engine'"):
        default_graph(engine, TOKENIZER, model_name="m", before={"router": [Recorder()]})
    with pytest.raises(ValueError, match="'preprocessor', 'parser', 'migration'"):
        build_app(engine, TOKENIZER, model_name="m", before={"frontend": [Recorder()]})


OPENAI_EVENTS = (ResponseHead, ChoiceStart, ChoiceDelta, Usage)


@pytest.mark.parametrize(
    ("point", "request_type", "output_types", "attempts"),
    [
        # outside the retry loop: one request, however many workers were lost
        ("preprocessor", (OpenAIRequest,), OPENAI_EVENTS, 1),
        ("migration", (PreprocessedRequest,), (BackendOutput,), 1),
        # inside it: the first attempt, then its continuation
        ("backend", (PreprocessedRequest,), (BackendOutput,), 2),
        ("encoder_router", (PreprocessedRequest,), (EngineOutput,), 2),
        ("prefill_router", (PreprocessedRequest,), (EngineOutput,), 2),
        ("engine", (PreprocessedRequest,), (EngineOutput,), 2),
    ],
)
async def test_an_inserted_operator_sees_what_its_point_carries_and_survives_a_migration(
    point: Any, request_type: tuple[type, ...], output_types: tuple[type, ...], attempts: int
) -> None:
    recorder = Recorder()
    engine = EchoEngine.from_tokenizer(TOKENIZER, fail_after_tokens=2)  # loses its worker
    app = build_app(engine, TOKENIZER, model_name="echo", before={point: [recorder]})
    async with openai_client(app) as client:
        reply = await client.completions.create(model="echo", prompt=PROMPT)
    assert reply.choices[0].text == PROMPT  # the client never noticed
    assert 'outcome="retried"} 1.0' in app.metrics.render().decode()
    assert len(recorder.requests) == attempts
    assert all(isinstance(request, request_type) for request in recorder.requests)
    assert recorder.outputs
    assert all(isinstance(output, output_types) for output in recorder.outputs)
    if attempts == 2:  # the continuation replays what the lost worker generated
        first, second = recorder.requests
        assert (first.replayed_tokens, second.replayed_tokens) == (0, 2)
        assert second.token_ids[: len(first.token_ids)] == first.token_ids


class Shout:
    """A text operator: before the Backend it fits, before the engine it does not."""

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput]:
        async for output in downstream.generate(ctx):
            yield rewritten(output, output.text.upper())


async def test_an_operator_before_the_backend_changes_what_the_client_gets() -> None:
    engine = EchoEngine.from_tokenizer(TOKENIZER, fail_after_tokens=1)
    app = build_app(engine, TOKENIZER, model_name="echo", before={"backend": [Shout()]})
    async with openai_client(app) as client:
        reply = await client.completions.create(model="echo", prompt=PROMPT)
        chat = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi there"}]
        )
    assert reply.choices[0].text == PROMPT.upper()
    assert chat.choices[0].message.content is not None
    assert "HI THERE" in chat.choices[0].message.content


class Unannotated:
    async def generate(self, ctx, downstream):  # type: ignore[no-untyped-def]
        async for item in downstream.generate(ctx):
            yield item


class OnlyForMypy:
    """Annotated with a type imported for mypy only: nothing to read at run time (read, the
    annotations would fit nowhere)."""

    async def generate(
        self, ctx: Context[Tool], downstream: Engine[Tool, Tool]
    ) -> AsyncIterator[Tool]:
        async for item in downstream.generate(ctx):
            yield item


@pytest.mark.parametrize("point", ["engine", "prefill_router", "preprocessor"])
def test_an_operator_that_does_not_fit_its_point_is_refused_naming_both(point: Any) -> None:
    stages = default_stages(TOKENIZER, model_name="m")
    with pytest.raises(LinkError) as refused:
        stages.insert_before(point, Shout())
    message = str(refused.value)
    assert message.startswith(f"Shout cannot go before {point!r}: its generate")
    assert "yields BackendOutput, not " in message
    assert message.endswith("(it fits before 'parser', 'migration', 'backend')")
    with pytest.raises(LinkError, match="Shout cannot go before 'engine'"):
        default_graph(EchoEngine(), TOKENIZER, model_name="m", before={"engine": [Shout()]})
    with pytest.raises(LinkError, match="Shout cannot go before 'encoder_router'"):
        stages.insert_after("backend", Shout())


def test_a_stage_replaced_by_one_that_does_not_fit_is_refused() -> None:
    stages = default_stages(TOKENIZER, model_name="m")
    with pytest.raises(LinkError, match="Migration cannot be the 'backend' stage: its generate "
                       "expects from downstream BackendOutput, not EngineOutput"):  # fmt: skip
        dataclasses.replace(stages, backend=Migration())
    assert isinstance(dataclasses.replace(stages, backend=Backend(TOKENIZER)).backend, Backend)


@pytest.mark.parametrize("operator", [Unannotated(), OnlyForMypy(), Recorder()])
def test_an_operator_whose_types_cannot_be_told_fits_anywhere(operator: Any) -> None:
    stages = default_stages(TOKENIZER, model_name="m")
    for point in POINTS:
        stages = stages.insert_before(point, operator)
    assert len(list(stages)) == len(STAGES) + len(POINTS)


def test_only_classes_that_cannot_meet_are_a_mismatch() -> None:
    assert not fits(BackendOutput, EngineOutput)
    assert not fits(str, PreprocessedRequest)
    assert fits(ChoiceDelta, OpenAIEvent)  # a member of the union
    assert fits(object, EngineOutput)  # a base
    for unknown in (None, Any, list[int], TypeVar("T")):
        assert fits(unknown, EngineOutput)


MYPY_SNIPPET = """
from operators.graph import default_stages
from operators.contracts.llm import BackendOutput, PreprocessedRequest
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, Stream


class Redact:
    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput]:
        async for output in downstream.generate(ctx):
            yield output


stages = default_stages(Tokenizer.default(), model_name="m")
stages.insert_before("backend", Redact())
stages.insert_after("migration", Redact())
stages.insert_before("preprocessor", Redact())  # line 21: OpenAI requests there
stages.insert_before("engine", Redact())  # line 22: engine outputs there
stages.insert_before("nope", Redact())  # line 23: no such stage
"""


@pytest.mark.slow
def test_mypy_rejects_an_operator_inserted_where_its_types_do_not_fit(tmp_path: Path) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(MYPY_SNIPPET))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            str(snippet),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["21", "22", "23"], result.stdout
    assert all("insert_before" in line for line in errors)
