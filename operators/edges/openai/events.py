"""The backward edge of the OpenAI layer: typed events, and folding them into responses.

:class:`~operators.edges.openai.OpenAIPreprocessor` yields these, one response's worth per
request, in this order::

    ResponseHead                       once, first: id, object, created, model
    ChoiceStart | ChoiceDelta ...      chat choices open with a ChoiceStart (the role chunk);
                                       a choice's last delta carries its finish_reason
    Usage                              once, last: the response's token counts (and the
                                       finish reasons, for traces and logs)

A chat delta that carries reasoning text or a tool-call piece is a :class:`RichDelta`, a
:class:`ChoiceDelta` subclass: content-only deltas, nearly every token of nearly every
response, keep the plain class and its cheap rendering, and code that only knows
``ChoiceDelta`` still sees every delta's content and finish_reason.

They are plain ``slots`` dataclasses, not chunk dicts, so that the HTTP server renders each
one to bytes exactly once (:mod:`operators.edges.openai.sse`, with the per-request constant part
rendered once per request, not per token) and nothing downstream inspects or mutates an
untyped dict. What a response *shows* is decided where it is rendered: :class:`Usage`
always ends the stream (it is also the server's token count), and the renderer writes it
only when the client asked for it. :func:`aggregate_chat` / :func:`aggregate_completion`
fold the same events into a non-streamed response, so both shapes come from one stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

from operators.contracts.llm import ToolCallDelta

__all__ = (
    "ChoiceDelta",
    "ChoiceStart",
    "OpenAIEvent",
    "ResponseHead",
    "RichDelta",
    "Usage",
    "aggregate_chat",
    "aggregate_completion",
)

_COMPLETION_LOGPROB_KEYS: Final = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@dataclass(slots=True, frozen=True)
class ResponseHead:
    """What every chunk of one response repeats: rendered once per request."""

    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    #: the prompt's tokens (all prompts' for a batch), known before the first output:
    #: an edge that reports them up front (Anthropic's ``message_start``) reads them here
    prompt_tokens: int | None = None


@dataclass(slots=True)
class ChoiceStart:
    """A chat choice opens: the ``{"role": "assistant", "content": ""}`` chunk."""

    index: int


@dataclass(slots=True)
class ChoiceDelta:
    """One step of one choice: text the client may see, its logprobs, maybe the finish.

    ``logprobs`` is already OpenAI-shaped for the endpoint (chat: ``{"content": [...],
    "refusal": None}``; completions: ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}``), and covers exactly the tokens delivered by this step.
    """

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    #: on the finishing delta: the stop string (or stop token id) that ended the choice;
    #: keyword-only, so that :class:`RichDelta`'s positional fields stay where they were
    stop_reason: str | int | None = field(default=None, kw_only=True)


@dataclass(slots=True)
class RichDelta(ChoiceDelta):
    """A chat delta with reasoning text or one piece of one tool call (besides ``text``).

    A subclass rather than two more fields on :class:`ChoiceDelta` so that a content-only
    delta costs exactly what it did (built with four slots, rendered by the text template
    after one type check) in a response without tools or reasoning. Chat responses build
    it with one kind of payload each (:class:`~.chunks.ChatChunks`), so each renders as one
    chunk with one of ``reasoning_content`` or a single ``tool_calls`` entry, the shape
    clients handle most reliably; the renderer and the aggregation accept any mix.
    """

    #: reasoning text (OpenAI-compatible servers' ``reasoning_content``)
    reasoning: str = ""
    #: one piece of one call: its first names it (``id``, ``name``), later ones add arguments
    tool_call: ToolCallDelta | None = None


@dataclass(slots=True)
class Usage:
    """The response's token counts: the last event of every response."""

    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens the engines found cached (None: they did not say)
    cached_tokens: int | None = None
    #: each finished choice's finish_reason, by choice index (for traces and logs; not
    #: part of OpenAI's ``usage``)
    finish_reasons: tuple[str, ...] = ()
    #: completion tokens spent reasoning: every token up to the last one whose output
    #: carried reasoning text (0 without a reasoning parser); chat and Responses report it
    reasoning_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object (``prompt_tokens_details`` when the engine reported
        its prefix cache's hits, ``completion_tokens_details`` when the model reasoned)."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


OpenAIEvent: TypeAlias = ResponseHead | ChoiceStart | ChoiceDelta | Usage
"""What the OpenAI preprocessor yields (a :class:`RichDelta` is a :class:`ChoiceDelta`)."""


def _head(events: list[OpenAIEvent]) -> ResponseHead:
    if not events or not isinstance(events[0], ResponseHead):
        raise ValueError("a response's events start with a ResponseHead")
    return events[0]


class _ChatChoice:
    """One chat choice being folded: its content, reasoning, calls, logprobs and finish."""

    __slots__ = ("calls", "content", "finish", "logprobs", "reasoning")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        #: call index -> ([id, name], its argument fragments)
        self.calls: dict[int, tuple[list[str | None], list[str]]] = {}
        self.logprobs: list[Any] | None = None
        self.finish: str | None = None

    def add_call(self, call: ToolCallDelta) -> None:
        found = self.calls.get(call.index)
        if found is None:
            found = self.calls[call.index] = ([None, None], [])
        names, arguments = found
        if call.id is not None:
            names[0] = call.id
        if call.name is not None:
            names[1] = call.name
        arguments.append(call.arguments)

    def message(self) -> dict[str, Any]:
        """OpenAI's ``message``: ``content`` is None for a reply that only calls tools."""
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self.calls and not content else content,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": names[0],
                    "type": "function",
                    "function": {"name": names[1], "arguments": "".join(arguments)},
                }
                for names, arguments in (self.calls[key] for key in sorted(self.calls))
            ]
        return message


def aggregate_chat(events: Iterable[OpenAIEvent]) -> dict[str, Any]:
    """Fold one chat response's events into a ``chat.completion`` object.

    A message has ``reasoning_content`` only when there was reasoning, ``tool_calls``
    (assembled by call index, in index order) only when there were calls; its ``content``
    is None when it called tools and said nothing, as OpenAI's is.

    Raises:
        ValueError: the events do not start with a :class:`ResponseHead`.
    """
    events = list(events)
    head = _head(events)
    usage: dict[str, int] | None = None
    choices: dict[int, _ChatChoice] = {}
    for event in events:
        if isinstance(event, ChoiceDelta):
            choice = choices.get(event.index)
            if choice is None:
                choice = choices[event.index] = _ChatChoice()
            if event.text:
                choice.content.append(event.text)
            if event.logprobs is not None:
                if choice.logprobs is None:
                    choice.logprobs = []
                choice.logprobs.extend(event.logprobs["content"])
            if event.finish_reason is not None:
                choice.finish = event.finish_reason
            if type(event) is RichDelta:
                if event.reasoning:
                    choice.reasoning.append(event.reasoning)
                if event.tool_call is not None:
                    choice.add_call(event.tool_call)
        elif isinstance(event, ChoiceStart):
            choices.setdefault(event.index, _ChatChoice())
        elif isinstance(event, Usage):
            usage = event.as_dict()
    return {
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {
                "index": index,
                "message": choice.message(),
                "logprobs": (
                    None
                    if choice.logprobs is None
                    else {"content": choice.logprobs, "refusal": None}
                ),
                "finish_reason": choice.finish,
            }
            for index, choice in sorted(choices.items())
        ],
        "usage": usage,
    }


def aggregate_completion(events: Iterable[OpenAIEvent]) -> dict[str, Any]:
    """Fold one completions response's events into a ``text_completion`` object.

    Raises:
        ValueError: the events do not start with a :class:`ResponseHead`.
    """
    events = list(events)
    head = _head(events)
    usage: dict[str, int] | None = None
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, dict[str, list[Any]]] = {}
    finishes: dict[int, str | None] = {}
    for event in events:
        if isinstance(event, ChoiceDelta):
            index = event.index
            texts.setdefault(index, []).append(event.text)
            finishes.setdefault(index, None)
            if event.logprobs is not None:
                merged = logprobs.get(index)
                if merged is None:
                    merged = logprobs[index] = {key: [] for key in _COMPLETION_LOGPROB_KEYS}
                for key, values in merged.items():
                    values.extend(event.logprobs[key])
            if event.finish_reason is not None:
                finishes[index] = event.finish_reason
        elif isinstance(event, Usage):
            usage = event.as_dict()
    return {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {
                "index": index,
                "text": "".join(texts[index]),
                "logprobs": logprobs.get(index),
                "finish_reason": finishes[index],
            }
            for index in sorted(texts)
        ],
        "usage": usage,
    }
