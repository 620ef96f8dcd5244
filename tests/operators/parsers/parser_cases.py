"""Model outputs with known parses, as Hypothesis strategies, and a reference driver.

A :class:`Case` is built from pieces whose parse is known by construction: plain text
(content), well-formed calls (their expected name and arguments), malformed calls (shown
verbatim as content) and reasoning blocks. Text pieces are drawn from snippets that are
fragments of every marker, multi-byte characters and JSON punctuation, so splits land
inside markers and characters; a case whose plain text happens to contain a whole marker
is rejected (its parse would not be the constructed one).
"""

from __future__ import annotations

import bisect
import itertools
import json
import keyword
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from operators.contracts.llm import Tool
from operators.parsers import ChoiceParser, ReasoningFormat, ToolCallFormat

TOOLS = (
    Tool(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    ),
    Tool(name="f"),
    Tool(name="ns.lookup"),
)
NAMES = [tool.name for tool in TOOLS]
MARKER = "<tool_call>"

SNIPPETS = [
    "Hi", " ", "\n", "é", "☀️", "日本", "<", ">", "<tool", "<tool_call", "tool_call>",
    "</tool_call>", "[TOOL", "[TOOL_CALLS", "TOOL_CALLS]", "<think", "think>", "</think>",
    "<|python", "{", "}", "[", "]", '"', ";", "(", ")", "\\",
]  # fmt: skip
# Strings inside JSON/Python values: brackets, quotes and escapes, never "<" (an end
# marker inside a string would end a hermes body early: a different, malformed case).
VALUE_ALPHABET = 'aZ é☀日"\\/[]{}():,;\n'

texts = st.lists(st.sampled_from(SNIPPETS), max_size=6).map("".join)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(VALUE_ALPHABET, max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(VALUE_ALPHABET, max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(VALUE_ALPHABET, max_size=6), json_values, max_size=3)
json_styles = st.sampled_from(
    [{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}]
)
spaces = st.sampled_from(["", " ", "\n", "\n\n  ", "\t"])


@dataclass
class Case:
    """A model output and its parse."""

    #: (kind, raw text) in order; kind is "text", "call", "bad", "think" or "open" (an
    #: unterminated piece at the end: its raw text runs to the end of the output)
    pieces: list[tuple[str, str]] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    #: what each piece shows: ("call", ""), ("reasoning", ""), or ("text", its content)
    shown: list[tuple[str, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(raw for _, raw in self.pieces)

    def add(self, kind: str, raw: str, *, content: str = "", reasoning: str = "",
            calls: Sequence[tuple[str, str]] = ()) -> None:  # fmt: skip
        self.pieces.append((kind, raw))
        self.content += content
        self.reasoning += reasoning
        self.calls.extend(calls)
        shown = "call" if calls else "reasoning" if reasoning and not content else "text"
        self.shown.append((shown, content))

    def drop_gaps_after_calls(self) -> None:
        """Marker formats drop whitespace between a call and the next call or the end
        (a newline between calls is not content); whitespace followed by other text is
        shown with it."""
        parts: list[str] = []
        gap: str | None = None
        for kind, content in self.shown:
            if kind == "reasoning":
                continue
            if kind == "call":
                gap = ""
                continue
            if gap is not None:
                if not content or content.isspace():
                    gap += content
                    continue
                parts.append(gap)
                gap = None
            parts.append(content)
        self.content = "".join(parts)

    def reject_stray(self, marker: str, transparent: tuple[str, ...] = ()) -> None:
        """Reject the case when consecutive text pieces (reading through pieces of the
        ``transparent`` kinds) join into ``marker``."""
        run: list[str] = []
        for kind, raw in [*self.pieces, ("end", "")]:
            if kind == "text":
                run.append(raw)
            elif kind not in transparent:
                assume(marker not in "".join(run))
                run = []


def expected_arguments(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False)


@st.composite
def call_objects(draw: st.DrawFn, key: str = "arguments") -> tuple[str, dict[str, Any], str]:
    """``(json text of a call object, its arguments, name)``."""
    name = draw(st.sampled_from(NAMES))
    args = draw(arguments)
    obj = {"name": name, key: args}
    if draw(st.booleans()):
        obj = {key: args, "name": name}
    return json.dumps(obj, **draw(json_styles)), args, name


MALFORMED_JSON = [
    '{"name": "get_weather", "arguments": {"city": ',
    '{"name": "launch_rockets", "arguments": {}}',
    '{"name": "f", "arguments": [1]}',
    '{"name": "f", "arguments": {"x": NaN}}',
    '{"name": "f", "args": {}}',
    '{"name": "f", "arguments": {}} trailing',
    "[1, 2]",
    "[]",
    "not json é",
    "",
]


@st.composite
def hermes_cases(draw: st.DrawFn, *, think: bool = False) -> Case:
    """Text, ``<tool_call>`` calls (well-formed or not) and, with ``think``, reasoning
    blocks, in any order; possibly an unterminated call or block at the end."""
    case = Case()
    kinds = ["text", "call", "bad"] + (["think"] if think else [])
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=7)):
        if kind == "text":
            text = draw(texts)
            case.add("text", text, content=text)
        elif kind == "call":
            body, args, name = draw(call_objects())
            raw = f"<tool_call>{draw(spaces)}{body}{draw(spaces)}</tool_call>"
            case.add("call", raw, calls=[(name, expected_arguments(args))])
        elif kind == "bad":
            raw = f"<tool_call>{draw(st.sampled_from(MALFORMED_JSON))}</tool_call>"
            case.add("bad", raw, content=raw)
        else:
            inner = draw(texts)
            assume("</think>" not in inner)
            case.add("think", f"<think>{inner}</think>", reasoning=inner)
    ending = draw(st.sampled_from(["none", "open call", "open bad", "open think"]))
    if ending == "open call":  # ended (a hidden stop string, EOS) before </tool_call>
        body, args, name = draw(call_objects())
        raw = f"<tool_call>{draw(spaces)}{body}"
        case.add("open", raw, calls=[(name, expected_arguments(args))])
    elif ending == "open bad":
        raw = '<tool_call>{"name": "f", "argu'
        case.add("open", raw, content=raw)
    elif ending == "open think" and think:
        inner = draw(texts)
        assume("</think>" not in inner)
        case.add("open", f"<think>{inner}", reasoning=inner)
    case.reject_stray("<tool_call>", transparent=("think",))
    case.drop_gaps_after_calls()
    if think:
        case.reject_stray("<think>", transparent=("call", "bad"))
    return case


@st.composite
def mistral_cases(draw: st.DrawFn) -> Case:
    """Text and ``[TOOL_CALLS]`` arrays (well-formed or not)."""
    case = Case()
    for kind in draw(st.lists(st.sampled_from(["text", "call", "bad", "word"]), max_size=6)):
        if kind == "text":
            text = draw(texts)
            case.add("text", text, content=text)
        elif kind == "call":
            objects = draw(st.lists(call_objects(), min_size=1, max_size=3))
            value = "[" + ", ".join(body for body, _, _ in objects) + "]"
            if len(objects) == 1 and draw(st.booleans()):
                value = objects[0][0]  # one call as a bare object
            calls = [(name, expected_arguments(args)) for _, args, name in objects]
            case.add("call", f"[TOOL_CALLS]{draw(spaces)}{value}", calls=calls)
        elif kind == "bad":
            bad = draw(st.sampled_from(MALFORMED_JSON[1:3] + MALFORMED_JSON[6:8]))
            raw = f"[TOOL_CALLS]{draw(spaces)}{bad}"
            case.add("bad", raw, content=raw)
        else:  # the marker followed by words, not a JSON value
            raw = f"[TOOL_CALLS]{draw(spaces)}"
            case.add("bad", raw, content=raw)
            case.add("text", "hello", content="hello")
    if draw(st.booleans()):
        raw = '[TOOL_CALLS] [{"name": "f", "argu'
        case.add("open", raw, content=raw)
    case.reject_stray("[TOOL_CALLS]")
    case.drop_gaps_after_calls()
    return case


def _separated(draw: st.DrawFn, bodies: list[str], separators: list[str]) -> str:
    out = bodies[0]
    for body in bodies[1:]:
        out += draw(st.sampled_from(separators)) + body
    return out


words = st.sampled_from(["Sure", "ok ☀️", "日本 {", "x[1]", "Paris;"])


@st.composite
def llama3_json_cases(draw: st.DrawFn) -> Case:
    """Whole outputs: calls (with or without the tag, separated by ``;``), plain text,
    a JSON object that is not a call, calls followed by text."""
    case = Case()
    lead = draw(spaces)
    shape = draw(st.sampled_from(["calls", "calls then text", "plain", "object", "partial tag"]))
    if shape in ("calls", "calls then text"):
        key = draw(st.sampled_from(["parameters", "arguments"]))
        objects = draw(st.lists(call_objects(key), min_size=1, max_size=3))
        tag = draw(st.sampled_from(["", "<|python_tag|>", "<|python_tag|>\n"]))
        body = _separated(draw, [b for b, _, _ in objects], [";", "; ", " ;\n", "\n"])
        calls = [(name, expected_arguments(args)) for _, args, name in objects]
        case.add("call", lead + tag + body, calls=calls)
        if shape == "calls then text":
            tail = draw(st.sampled_from(["", " ", ";", "; "])) + draw(words) + draw(texts)
            case.add("text", tail, content=tail)
        else:
            case.add("call", draw(spaces))  # trailing whitespace: swallowed
    elif shape == "plain":
        text = lead + draw(words) + draw(texts)
        case.add("text", text, content=text)
    elif shape == "object":
        text = lead + draw(st.sampled_from(['{"answer": 42}', "{}", '{"name": "nope"}']))
        text += draw(texts)
        case.add("bad", text, content=text)
    else:
        text = lead + "<|python" + draw(words)
        case.add("text", text, content=text)
    return case


identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(
    lambda name: not keyword.iskeyword(name)
)


@st.composite
def pythonic_cases(draw: st.DrawFn) -> Case:
    """Whole outputs: a list of calls, plain text, a list that is not calls."""
    case = Case()
    lead = draw(spaces)
    shape = draw(st.sampled_from(["calls", "calls then text", "plain", "not calls"]))
    if shape in ("calls", "calls then text"):
        rendered, calls = [], []
        for _ in range(draw(st.integers(1, 3))):
            name = draw(st.sampled_from(NAMES))
            kwargs = draw(st.dictionaries(identifiers, json_values, max_size=3))
            inner = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
            rendered.append(f"{name}({inner})")
            calls.append((name, expected_arguments(kwargs)))
        case.add("call", lead + "[" + ", ".join(rendered) + "]", calls=calls)
        if shape == "calls then text":
            tail = draw(spaces) + draw(words) + draw(texts)
            case.add("text", tail, content=tail)
        else:
            case.add("call", draw(spaces))
    elif shape == "plain":
        text = lead + draw(words) + draw(texts)
        case.add("text", text, content=text)
    else:
        text = lead + draw(
            st.sampled_from(
                ["[1, 2] are numbers", "[see](url)", "[f(1)]", "[f(x=y)]", "[f(x=1)", "[]"]
            )
        )
        if not text.endswith("[f(x=1)"):  # (more text could close that one into a call)
            text += draw(texts)
        case.add("bad", text, content=text)
    return case


@st.composite
def splits(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut at arbitrary character positions (any number of pieces)."""
    if len(text) < 2:
        return [text] if text else []
    cuts = sorted(draw(st.sets(st.integers(1, len(text) - 1), max_size=len(text))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@dataclass
class Result:
    content: str
    reasoning: str
    calls: list[tuple[str, str]]
    #: (fed, consumed) after each feed
    progress: list[tuple[int, int]]
    ids: list[str]


def parse(
    pieces: Sequence[str],
    tool_format: ToolCallFormat | None,
    reasoning_format: ReasoningFormat | None = None,
    tools: Sequence[Tool] = TOOLS,
) -> Result:
    """Feed ``pieces`` to a fresh :class:`ChoiceParser` and assemble what it released the
    way a client assembles a stream: strings joined, call pieces joined by index."""
    parser = ChoiceParser(
        None if reasoning_format is None else reasoning_format.parser(),
        None if tool_format is None else tool_format.parser(tools),
    )
    outputs = []
    progress = []
    for piece in pieces:
        outputs.append(parser.feed(piece))
        progress.append((parser.fed, parser.consumed))
    outputs.append(parser.finish())
    assert parser.consumed == parser.fed, "finish() releases everything"
    heads: dict[int, list[str]] = {}
    ids = []
    for output in outputs:
        for delta in output.calls:
            if delta.id is not None:
                assert delta.index not in heads, "one head per call"
                assert delta.arguments == ""
                heads[delta.index] = [delta.name or "", ""]
                ids.append(delta.id)
            else:
                assert delta.name is None
                heads[delta.index][1] += delta.arguments
    assert sorted(heads) == list(range(len(heads))), "calls are numbered 0, 1, ..."
    return Result(
        "".join(output.content for output in outputs),
        "".join(output.reasoning for output in outputs),
        [(name, args) for name, args in (heads[i] for i in sorted(heads))],
        progress,
        ids,
    )


def held_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for held in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[len(text) - held :]):
            return held
    return 0


def decided(case: Case, fed: int, *, think: bool, tools: bool) -> int:
    """How much of ``case.text[:fed]`` a hermes parser behind a think parser (either may
    be absent) has decided, from the case's construction: everything before the first
    character either withholds (a possible marker, an open block or call)."""
    text = case.text
    content_raw: list[int] = []  # the raw position of each content character
    calls: list[tuple[str, int, int]] = []  # call-like pieces, in content positions
    blocks: list[tuple[int, int, bool]] = []  # reasoning blocks: raw start, end, closed
    position = 0
    for kind, raw in case.pieces:
        if think and (kind == "think" or (kind == "open" and raw.startswith("<think>"))):
            blocks.append((position, position + len(raw), kind == "think"))
        else:
            if kind != "text":
                calls.append((kind, len(content_raw), len(content_raw) + len(raw)))
            content_raw.extend(range(position, position + len(raw)))
        position += len(raw)
    reasoning_held = held_suffix(text[:fed], "<think>") if think else 0
    for start, end, closed in blocks:
        if start < fed and (fed < end or not closed):
            inside = fed - start
            if inside >= len("<think>"):
                inside = held_suffix(text[start + len("<think>") : fed], "</think>")
            reasoning_held = inside
    released = fed - reasoning_held
    if not tools:
        return released
    content_count = bisect.bisect_left(content_raw, released)  # content the tools got
    content = "".join(text[i] for i in content_raw[:content_count])
    first_held = content_count - held_suffix(content, MARKER)
    for kind, start, end in calls:
        if start < content_count and (content_count < end or kind == "open"):
            first_held = start
    # whitespace right after a call is withheld until something other than calls follows
    ended = [(end, kind) for kind, _, end in calls if end <= first_held]
    if ended:
        end, kind = max(ended)
        if kind == "call" and content[end:first_held].isspace():
            first_held = end
    return content_raw[first_held] if first_held < content_count else released
