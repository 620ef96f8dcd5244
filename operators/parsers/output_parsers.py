"""The operator that moves reasoning and tool calls out of the Backend's text.

It sits between the preprocessor and Migration (the default graph's ``parser`` stage):
above Migration it sees every token once, whichever worker produced it, and a lost worker
is invisible to it. Per choice it runs a :class:`~.choice.ChoiceParser` and yields each
:class:`~operators.contracts.llm.BackendOutput` with the same tokens and logprobs, but with ``text``
narrowed to content, ``reasoning`` and ``tool_calls`` filled in, and ``delivered_tokens``
recomputed: a token is delivered once the parsers have decided the text it starts with
(shown it, moved it, or swallowed it as markup), never while they still withhold it, so a
client's logprobs never run ahead of what it has read. A choice that made a call and
stopped reports ``finish_reason: "tool_calls"``.

A request without tools, with no reasoning format configured, costs nothing: ``generate``
hands back downstream's own stream (no hop per token, see :func:`pipeline.link`).

The parsers' state lives in the request's Context state, so the operator also works below
a retrying operator (``check_operator(..., retry=True)``), though its place is above one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

from operators.contracts.llm import BackendOutput, PreprocessedRequest
from pipeline import Context, Engine, StateKey, Stream

from .base import Parsed
from .choice import ChoiceParser

if TYPE_CHECKING:
    from operators.contracts.llm import FinishReason, Tool, ToolCallDelta

    from .base import ReasoningFormat, ToolCallFormat

__all__ = ("CallIds", "OutputParsers")

CallIds = Callable[[int, int], str]
"""``(choice index, call index) -> call id``: ids chosen by the caller (reproducible)."""


class _Choice:
    """The parser state of one choice, and which of its tokens have been delivered."""

    __slots__ = (
        "backend_delivered",
        "calls",
        "delivered",
        "finished",
        "parser",
        "seen",
        "starts",
        "text",
    )

    def __init__(self, parser: ChoiceParser) -> None:
        self.parser = parser
        self.starts: deque[int] = deque()  # start offsets of tokens not delivered yet
        self.text = 0  # characters of token text so far
        self.seen = 0  # tokens so far
        self.delivered = 0  # tokens delivered, as last reported
        self.backend_delivered = 0  # the Backend's count, as last reported
        self.calls = 0  # calls emitted
        self.finished = False

    def step(self, output: BackendOutput, call_ids: CallIds | None) -> BackendOutput:
        """``output`` with its text parsed (``output`` itself when parsing changed nothing:
        plain text, nothing withheld)."""
        parser = self.parser
        text = output.text
        parsed = parser.feed(text) if text else None
        finish: FinishReason | None = output.finish_reason
        if finish is not None:
            self.finished = True
            rest = parser.finish()
            parsed = rest if parsed is None else _joined(parsed, rest)
        calls = None
        if parsed is None:
            content, reasoning = "", ""
        else:
            content, reasoning = parsed.content, parsed.reasoning
            if parsed.calls:
                calls = list(parsed.calls)
                self._named(calls, output.index, call_ids)
        if finish == "stop" and self.calls:
            finish = "tool_calls"
        tokens = output.tokens
        self.backend_delivered = backend = output.delivered_tokens
        delivered = self._delivered(tokens)
        if content == text and not reasoning and calls is None and delivered == backend:
            if finish == output.finish_reason:
                return output  # (the common case: saves building an output per token)
        # positional (as the Backend builds them): ids, tokens, text, logprobs, top_logprobs,
        # finish_reason, stop_reason, index, delivered_tokens, reasoning, tool_calls
        return BackendOutput(
            output.token_ids,
            tokens,
            content,
            output.logprobs,
            output.top_logprobs,
            finish,
            output.stop_reason,
            output.index,
            delivered,
            reasoning,
            calls,
        )

    def flush(self, index: int, call_ids: CallIds | None) -> BackendOutput:
        """The stream ended without finishing this choice: release what is withheld."""
        parsed = self.parser.finish()
        calls = list(parsed.calls) if parsed.calls else None
        if calls is not None:
            self._named(calls, index, call_ids)
        return BackendOutput(
            [], [], parsed.content, None, None, None, None, index, self._delivered(()),
            parsed.reasoning, calls,
        )  # fmt: skip

    def _named(self, calls: list[ToolCallDelta], index: int, call_ids: CallIds | None) -> None:
        for call in calls:
            if call.id is not None:
                self.calls += 1
                if call_ids is not None:
                    call.id = call_ids(index, call.index)

    def _delivered(self, tokens: Sequence[str]) -> int:
        """Take in the output's tokens; the tokens delivered so far: those that start
        before the first withheld character, at most the Backend's count (its count when
        nothing is withheld)."""
        parser = self.parser
        consumed = parser.consumed
        starts = self.starts
        position = self.text
        for token in tokens:
            if starts or position >= consumed:  # (a token decided already is not kept)
                starts.append(position)
            position += len(token)
        self.text = position
        self.seen += len(tokens)
        while starts and starts[0] < consumed:
            starts.popleft()
        delivered = self.backend_delivered
        if consumed < parser.fed:
            delivered = min(delivered, self.seen - len(starts))
        if delivered > self.delivered:
            self.delivered = delivered
        return self.delivered


def _joined(first: Parsed, second: Parsed) -> Parsed:
    return Parsed(
        first.content + second.content,
        first.reasoning + second.reasoning,
        [*first.calls, *second.calls],
    )


_CHOICES = StateKey[dict[int, _Choice]]("parsers.choices")


class OutputParsers:
    """Operator: reasoning and tool calls out of ``BackendOutput.text``, per choice.

    ``tool_format`` parses calls for requests that offer tools (None: never);
    ``reasoning_format`` parses reasoning for every request (None: never). ``call_ids``
    names calls (by choice and call index) instead of random ``call_...`` ids: for tests
    that compare whole outputs.
    """

    def __init__(
        self,
        tool_format: ToolCallFormat | None = None,
        reasoning_format: ReasoningFormat | None = None,
        *,
        call_ids: CallIds | None = None,
    ) -> None:
        #: the tool-call format (None: tool calls are not parsed)
        self.tool_format = tool_format
        #: the reasoning format (None: reasoning is not parsed)
        self.reasoning_format = reasoning_format
        self._call_ids = call_ids

    def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput]:
        """Parse ``ctx``'s outputs; downstream's own stream when there is nothing to parse."""
        tools = ctx.data.tools if self.tool_format is not None else ()
        if not tools and self.reasoning_format is None:
            return downstream.generate(ctx)
        return self._parsed(ctx, downstream, tools)

    async def _parsed(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
        tools: tuple[Tool, ...],
    ) -> Stream[BackendOutput]:
        choices = ctx.state.setdefault(_CHOICES, {})
        call_ids = self._call_ids
        async with aclosing(downstream.generate(ctx)) as stream:
            async for output in stream:
                choice = choices.get(output.index)
                if choice is None:
                    choice = choices[output.index] = self._choice(tools)
                elif choice.finished:
                    yield output
                    continue
                yield choice.step(output, call_ids)
        for index, choice in sorted(choices.items()):
            if not choice.finished and choice.parser.consumed < choice.parser.fed:
                choice.finished = True
                yield choice.flush(index, call_ids)

    def _choice(self, tools: tuple[Tool, ...]) -> _Choice:
        reasoning = self.reasoning_format
        tool_format = self.tool_format
        return _Choice(
            ChoiceParser(
                None if reasoning is None else reasoning.parser(),
                tool_format.parser(tools) if tools and tool_format is not None else None,
            )
        )

    def __repr__(self) -> str:
        tools = getattr(self.tool_format, "name", self.tool_format)
        reasoning = getattr(self.reasoning_format, "name", self.reasoning_format)
        return f"OutputParsers(tools={tools!r}, reasoning={reasoning!r})"
