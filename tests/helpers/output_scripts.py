"""Random parser releases for the edges' backward halves: what a choice says (a
:class:`Script`: reasoning, content and tool calls) and the BackendOutputs it is cut into,
at random token boundaries, for property tests of every edge's rendering."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hypothesis import strategies as st

from operators.contracts.llm import BackendOutput, FinishReason, ToolCallDelta
from operators.edges.openai.chunks import TokenTexts
from operators.edges.openai.events import ResponseHead

__all__ = (
    "CUTS",
    "HEAD",
    "TEXT",
    "TEXTS",
    "Atom",
    "FakeDecoder",
    "Script",
    "outputs_of",
    "pieces",
    "responses",
    "scripts",
)


class FakeDecoder:
    """Token id -> text for logprobs, without a tokenizer."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{token_id}>" for token_id in ids)

    def id_to_token(self, token_id: int) -> str | None:
        return None


TEXTS = TokenTexts(FakeDecoder())
HEAD = ResponseHead("chatcmpl-1", "chat.completion.chunk", 1700000000, "m")

# One step of a parser's release, for one choice.
Atom = tuple[Literal["reasoning", "content"], str] | ToolCallDelta


@dataclass
class Script:
    """What one choice says: the ground truth its outputs are cut from."""

    reasoning: str
    content: str
    #: (id, name, arguments) of each call, in call order
    calls: list[tuple[str, str, str]]
    finish: FinishReason
    atoms: list[Atom]


def pieces(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at ``cuts`` (positions, any order, repeats allowed): empty pieces too."""
    points = [0, *sorted(cut % (len(text) + 1) for cut in cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(points)]


TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
CUTS = st.lists(st.integers(0, 40), max_size=3)


@st.composite
def scripts(draw: st.DrawFn, choice: int) -> Script:
    """A choice's reasoning, then content, with calls after (or between) content pieces."""
    reasoning = draw(TEXT)
    content_parts = draw(st.lists(TEXT, min_size=1, max_size=3))
    calls = [
        (f"call_{choice}_{k}", draw(st.sampled_from(["get_weather", "now", "f"])), draw(TEXT))
        for k in range(draw(st.integers(0, 3)))
    ]
    atoms: list[Atom] = [("reasoning", piece) for piece in pieces(reasoning, draw(CUTS)) if piece]
    for k, (call_id, name, arguments) in enumerate(calls):
        if k < len(content_parts):  # text before the call
            atoms += [("content", piece) for piece in pieces(content_parts[k], draw(CUTS)) if piece]
        atoms.append(ToolCallDelta(k, "", call_id, name))
        atoms += [ToolCallDelta(k, piece) for piece in pieces(arguments, draw(CUTS)) if piece]
    for part in content_parts[len(calls) :]:  # text after the calls
        atoms += [("content", piece) for piece in pieces(part, draw(CUTS)) if piece]
    content = "".join(atom[1] for atom in atoms if isinstance(atom, tuple) and atom[0] == "content")
    finish: FinishReason = "tool_calls" if calls else draw(st.sampled_from(["stop", "length"]))
    return Script(reasoning, content, calls, finish, atoms)


@st.composite
def outputs_of(draw: st.DrawFn, script: Script, index: int, logprobs: bool) -> list[BackendOutput]:
    """The script's atoms grouped into consecutive outputs, each of one or more tokens."""
    atoms = script.atoms
    ends = sorted(set(draw(st.lists(st.integers(1, max(len(atoms), 1)), max_size=len(atoms)))))
    groups = [atoms[a:b] for a, b in itertools.pairwise([0, *ends, len(atoms)])]
    outputs = []
    for number, group in enumerate(groups):
        last = number == len(groups) - 1
        reasoning = "".join(a[1] for a in group if isinstance(a, tuple) and a[0] == "reasoning")
        text = "".join(a[1] for a in group if isinstance(a, tuple) and a[0] == "content")
        calls = [a for a in group if isinstance(a, ToolCallDelta)]
        ids = [100 + number] * draw(st.integers(1, 2))
        outputs.append(
            BackendOutput(
                ids,
                [""] * len(ids),
                text,
                [-0.5] * len(ids) if logprobs else None,
                [[(7, -1.0)]] * len(ids) if logprobs else None,
                script.finish if last else None,
                None,
                index,
                0,  # filled in below: every token delivered by its own output
                reasoning,
                calls or None,
            )
        )
    delivered = 0
    for output in outputs:
        delivered += len(output.token_ids)
        output.delivered_tokens = delivered
    return outputs


@st.composite
def responses(draw: st.DrawFn) -> tuple[list[Script], list[BackendOutput], bool]:
    """n choices' scripts and their outputs, interleaved at random (each choice's in order).

    Every choice first gets an empty output, in index order, as engines start choices: the
    SDK's accumulator numbers choices by arrival.
    """
    n = draw(st.integers(1, 3))
    logprobs = draw(st.booleans())
    chosen = [draw(scripts(index)) for index in range(n)]
    queues = [draw(outputs_of(script, i, logprobs)) for i, script in enumerate(chosen)]
    merged = [BackendOutput([], [], "", index=index) for index in range(n)]
    while any(queues):
        queue = draw(st.sampled_from([q for q in queues if q]))
        merged.append(queue.pop(0))
    return chosen, merged, logprobs
