"""A text-rewriting operator keeps logprobs consistent with what the client reads.

``Redact`` (below) is the kind of operator users write: it replaces a word that may arrive
split across tokens. Written with ``operators.contracts.rewriting``, no token of the word reaches
the client through logprobs and usage still counts every token. It sits above Migration
(where a retry is invisible), so a lost worker at any token changes nothing the client
reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.backend import Backend
from operators.contracts.llm import BackendOutput
from operators.contracts.rewriting import joined, rewritten
from operators.edges.openai.preprocessor import OpenAIPreprocessor
from operators.edges.openai.server import OpenAIApp
from operators.engines import EchoEngine
from operators.migration import Migration
from operators.testing import make_request, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, Stream, link
from pipeline.testing import ConformanceError, ScriptedEngine, check_operator, collect, make_context

if TYPE_CHECKING:
    from operators.contracts.llm import PreprocessedRequest

WORD = " Rumpelstiltskin"  # seven tokens
MASK = " [redacted]"


def _may_grow_into(text: str, word: str) -> bool:
    """Whether some suffix of ``text`` is a proper prefix of ``word``."""
    return any(text.endswith(word[:k]) for k in range(1, len(word)))


class Redact:
    """Replaces ``word`` in every choice's text, holding outputs while it may still appear."""

    def __init__(self, word: str = WORD, mask: str = MASK) -> None:
        self.word = word
        self.mask = mask

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput]:
        held: dict[int, list[BackendOutput]] = {}  # per choice, what may still be rewritten
        async for output in downstream.generate(ctx):
            group = held.setdefault(output.index, [])
            group.append(output)
            text = "".join(out.text for out in group)
            if output.finish_reason is None and _may_grow_into(text, self.word):
                continue
            del held[output.index]
            out = joined(group)
            if self.word in text:
                out = rewritten(out, text.replace(self.word, self.mask))
            yield out


def _out(ids: list[int], text: str, *, delivered: int, finish: str | None = None) -> BackendOutput:
    return BackendOutput(
        ids,
        [f"<{i}>" for i in ids],
        text,
        [-0.5] * len(ids),
        [[(i, -0.5)] for i in ids],
        finish,  # type: ignore[arg-type]
        None,
        0,
        delivered,
    )


def test_joined_concatenates_in_order() -> None:
    first = _out([1, 2], "ab", delivered=2)
    second = _out([3], "c", delivered=3, finish="stop")
    out = joined([first, second])
    assert (out.token_ids, out.tokens, out.text) == ([1, 2, 3], ["<1>", "<2>", "<3>"], "abc")
    assert out.logprobs == [-0.5] * 3
    assert out.top_logprobs == [[(1, -0.5)], [(2, -0.5)], [(3, -0.5)]]
    assert (out.finish_reason, out.delivered_tokens) == ("stop", 3)
    assert first.token_ids == [1, 2]  # arguments are not mutated


def test_joined_drops_logprobs_unless_every_output_has_them() -> None:
    bare = BackendOutput([2], ["b"], "b", delivered_tokens=2)
    out = joined([_out([1], "a", delivered=1), bare])
    assert out.logprobs is None
    assert out.top_logprobs is None


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ([], "at least one"),
        ([_out([1], "a", delivered=1), BackendOutput([2], ["b"], "b", index=1)], "one choice"),
        ([_out([1], "a", delivered=1, finish="stop"), _out([2], "b", delivered=2)], "finish"),
    ],
)
def test_joined_refuses_what_cannot_be_one_output(
    outputs: list[BackendOutput], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        joined(outputs)


def test_rewritten_hides_logprobs_and_keeps_the_tokens() -> None:
    original = _out([1, 2], "ab", delivered=2, finish="length")
    out = rewritten(original, "xy")
    assert (out.text, out.logprobs, out.top_logprobs) == ("xy", None, None)
    assert (out.token_ids, out.finish_reason, out.delivered_tokens) == ([1, 2], "length", 2)
    assert original.text == "ab"


def _app(tokenizer: Tokenizer, *, fail_after_tokens: int | None = None) -> OpenAIApp:
    engine = EchoEngine.from_tokenizer(tokenizer, fail_after_tokens=fail_after_tokens)
    graph = link(
        OpenAIPreprocessor(tokenizer, model_name="echo"),
        Redact(),
        Migration(3),
        Backend(tokenizer),
        engine,
    )
    return OpenAIApp(graph, model_name="echo")


PROMPT = "the word Rumpelstiltskin is a name, Rumpelstiltskinny too, and alone"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


@pytest.mark.parametrize("fail_after_tokens", [None, *range(1, 27)])
async def test_no_redacted_token_reaches_the_client(
    tokenizer: Tokenizer, fail_after_tokens: int | None
) -> None:
    secret_ids = set(tokenizer.encode(WORD))
    async with openai_client(_app(tokenizer, fail_after_tokens=fail_after_tokens)) as client:
        stream = await client.completions.create(
            model="echo", prompt=PROMPT, max_tokens=64, stream=True, logprobs=2
        )
        text, tokens, top = "", [], []
        async for chunk in stream:
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                top += [alt for entry in choice.logprobs.top_logprobs or [] for alt in entry]
        reply = await client.completions.create(
            model="echo", prompt=PROMPT, max_tokens=64, logprobs=2
        )
    expected = PROMPT.replace(WORD, MASK)
    assert text == expected
    assert reply.choices[0].text == expected
    shown = "".join(tokens)
    assert "Rumpelstiltskin" not in shown
    assert " R" not in tokens  # the word's first token: held, then hidden, every time
    assert not {tokenizer.decode([i]) for i in secret_ids} & set(top)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(tokenizer.encode(PROMPT))
    # what the logprobs do show is text the client read, at its offset in that text
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens
    assert logprobs.text_offset is not None
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert expected[offset : offset + len(token)] == token


PIECES = ["a", " R", "ump", "elstilts", "kin", " Rumpelstiltskin", "s", "!"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(PIECES)))
def test_redact_over_any_token_split(pieces: list[str]) -> None:
    """Whatever the split, the text read is the redacted whole and no held logprob leaks."""
    total = len(pieces)
    outputs = [
        _out([i], piece, delivered=i + 1, finish="stop" if i == total - 1 else None)
        for i, piece in enumerate(pieces)
    ]
    graph = link(Redact(), ScriptedEngine(outputs))
    result = anyio.run(collect, graph, make_context(make_request()))
    assert "".join(out.text for out in result) == "".join(pieces).replace(WORD, MASK)
    assert sorted(i for out in result for i in out.token_ids) == list(range(total))
    shown = [pieces[i] for out in result if out.logprobs is not None for i in out.token_ids]
    assert "Rumpelstiltskin" not in "".join(shown)


async def test_the_redactor_keeps_the_operator_contract_where_it_belongs() -> None:
    pieces = ["a", " R", "ump", "elstilts", "kin", "!"]
    outputs = [
        _out([i], piece, delivered=i + 1, finish="stop" if i == len(pieces) - 1 else None)
        for i, piece in enumerate(pieces)
    ]
    await check_operator(Redact, make_request(), outputs)
    # retry=True plays what Migration does to the operators *below* it: a new Redact per
    # attempt, so what the lost attempt held in its locals is gone. Above Migration, where
    # a redactor goes, no retry reaches it (test_no_redacted_token_reaches_the_client loses
    # workers at every token): the failure is right, and says where retry=True applies.
    with pytest.raises(ConformanceError, match="above it is never retried") as failed:
        await check_operator(Redact, make_request(), outputs, retry=True)
    assert failed.value.rule == "keep per-request state in ctx.state"
