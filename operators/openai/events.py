"""The backward edge of the OpenAI layer: typed events, and folding them into responses.

:class:`~operators.openai.OpenAIPreprocessor` yields these, one response's worth per
request, in this order::

    ResponseHead                       once, first: id, object, created, model
    ChoiceStart | ChoiceDelta ...      chat choices open with a ChoiceStart (the role chunk);
                                       a choice's last delta carries its finish_reason
    Usage                              once, last: the response's token counts

They are plain ``slots`` dataclasses, not chunk dicts, so that the HTTP server renders each
one to bytes exactly once (:mod:`operators.openai.sse`, with the per-request constant part
rendered once per request, not per token) and nothing downstream inspects or mutates an
untyped dict. What a response *shows* is decided where it is rendered: :class:`Usage`
always ends the stream (it is also the server's token count), and the renderer writes it
only when the client asked for it. :func:`aggregate_chat` / :func:`aggregate_completion`
fold the same events into a non-streamed response, so both shapes come from one stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

__all__ = (
    "ChoiceDelta",
    "ChoiceStart",
    "OpenAIEvent",
    "ResponseHead",
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


@dataclass(slots=True)
class Usage:
    """The response's token counts: the last event of every response."""

    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        """OpenAI's ``usage`` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


OpenAIEvent: TypeAlias = ResponseHead | ChoiceStart | ChoiceDelta | Usage
"""What the OpenAI preprocessor yields."""


def _head(events: list[OpenAIEvent]) -> ResponseHead:
    if not events or not isinstance(events[0], ResponseHead):
        raise ValueError("a response's events start with a ResponseHead")
    return events[0]


def aggregate_chat(events: Iterable[OpenAIEvent]) -> dict[str, Any]:
    """Fold one chat response's events into a ``chat.completion`` object.

    Raises:
        ValueError: the events do not start with a :class:`ResponseHead`.
    """
    events = list(events)
    head = _head(events)
    usage: dict[str, int] | None = None
    contents: dict[int, list[str]] = {}
    logprobs: dict[int, list[Any]] = {}
    finishes: dict[int, str | None] = {}
    for event in events:
        if isinstance(event, ChoiceDelta):
            contents.setdefault(event.index, []).append(event.text)
            finishes.setdefault(event.index, None)
            if event.logprobs is not None:
                logprobs.setdefault(event.index, []).extend(event.logprobs["content"])
            if event.finish_reason is not None:
                finishes[event.index] = event.finish_reason
        elif isinstance(event, ChoiceStart):
            contents.setdefault(event.index, [])
            finishes.setdefault(event.index, None)
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
                "message": {"role": "assistant", "content": "".join(contents[index])},
                "logprobs": (
                    {"content": logprobs[index], "refusal": None} if index in logprobs else None
                ),
                "finish_reason": finishes[index],
            }
            for index in sorted(contents)
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
