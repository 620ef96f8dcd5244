"""Rendering one response's events as server-sent events: bytes, once per event.

The per-request constant part of every chunk (``id``, ``object``, ``created``, ``model``)
is rendered once, when the :class:`SseRenderer` is made; a plain text delta, the event
nearly every token becomes, is then a single ``bytes %`` of a prepared template around
``orjson.dumps(text)``; a reasoning-only :class:`~.events.RichDelta` (every token of a
reasoning model's thinking) has its own template. Events with logprobs, a finish reason or
a tool-call piece are rare and take the general path (a small dict through orjson). The
JSON is the same either way::

    data: {"id":"chatcmpl-..","object":"chat.completion.chunk","created":1700000000,
           "model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,
           "finish_reason":null}]}\\n\\n

``include_usage`` decides two things the event stream itself does not: whether every
chunk carries ``"usage": null`` and whether the final :class:`~.events.Usage` is written
(as a chunk with ``choices: []``).

Chat deltas are shaped as OpenAI-compatible servers stream them: ``content`` only when
there is content, ``reasoning_content`` for reasoning text, and ``tool_calls`` with one
entry: ``{"index", "id", "type": "function", "function": {"name", "arguments"}}`` for a
call's first piece, ``{"index", "function": {"arguments"}}`` for the fragments after it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, final

import orjson

from operators.contracts.llm import ToolCallDelta

from .events import ChoiceDelta, ChoiceStart, OpenAIEvent, ResponseHead, RichDelta, Usage

__all__ = ("DONE", "SseRenderer", "is_visible", "stream_chunks")

#: the last event of a successful stream
DONE: Final = b"data: [DONE]\n\n"

_dumps = orjson.dumps


def is_visible(event: OpenAIEvent) -> bool:
    """True for an event that shows the client text: the first one commits the response.

    Reasoning text and tool-call pieces count as text. Everything else (the head, a chat
    role chunk, a finish-only delta, usage) is written together with what follows it.
    """
    kind = type(event)
    if kind is ChoiceDelta:
        return bool(event.text)  # type: ignore[union-attr]
    if kind is RichDelta:
        rich: RichDelta = event  # type: ignore[assignment]
        return bool(rich.text or rich.reasoning) or rich.tool_call is not None
    return False


@final
class SseRenderer:
    """Renders the events of one response (the one ``head`` names) as SSE bytes."""

    __slots__ = (
        "_chat",
        "_general",
        "_include_usage",
        "_reasoning",
        "_start",
        "_text",
        "_usage",
        "output_tokens",
        "usage",
    )

    def __init__(self, head: ResponseHead, *, include_usage: bool) -> None:
        #: the response's completion tokens, once its Usage went by (for the metrics)
        self.output_tokens = 0
        #: the response's Usage event, once it went by (for traces)
        self.usage: Usage | None = None
        self._chat = head.object == "chat.completion.chunk"
        self._include_usage = include_usage
        common = (
            b'data: {"id":'
            + _dumps(head.id)
            + b',"object":'
            + _dumps(head.object)
            + b',"created":'
            + _dumps(head.created)
            + b',"model":'
            + _dumps(head.model)
        )
        suffix = b"]" + (b',"usage":null' if include_usage else b"") + b"}\n\n"
        prefix = common + b',"choices":['
        # The templates are used with ``%``: the head's own bytes must not be read as format.
        escaped = prefix.replace(b"%", b"%%")
        suffix_escaped = suffix.replace(b"%", b"%%")
        if self._chat:
            text = b'{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}'
            start = b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,'
            start += b'"finish_reason":null}'
            reasoning = b'{"index":%d,"delta":{"reasoning_content":%s},"logprobs":null,'
            reasoning += b'"finish_reason":null}'
        else:
            text = b'{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}'
            start = reasoning = b""
        self._text = escaped + text + suffix_escaped
        self._reasoning = escaped + reasoning + suffix_escaped
        self._start = escaped + start + suffix_escaped
        self._general = (prefix, suffix)
        self._usage = common + b',"choices":[],"usage":'

    def render(self, event: OpenAIEvent) -> bytes:
        """The bytes for ``event``: one ``data:`` line, or b"" for what is not written."""
        kind = type(event)
        if kind is ChoiceDelta:
            delta: ChoiceDelta = event  # type: ignore[assignment]
            if delta.logprobs is None and delta.finish_reason is None and delta.text:
                return self._text % (delta.index, _dumps(delta.text))
            prefix, suffix = self._general
            return prefix + _dumps(self._choice(delta)) + suffix
        if kind is RichDelta:
            rich: RichDelta = event  # type: ignore[assignment]
            if not self._chat:  # completions have neither: their text only
                prefix, suffix = self._general
                return prefix + _dumps(self._choice(rich)) + suffix
            if (
                rich.tool_call is None
                and rich.logprobs is None
                and rich.finish_reason is None
                and not rich.text
            ):
                return self._reasoning % (rich.index, _dumps(rich.reasoning))
            prefix, suffix = self._general
            return prefix + _dumps(self._rich_choice(rich)) + suffix
        if kind is ChoiceStart:
            if not self._chat:  # completions choices have no role chunk
                return b""
            return self._start % event.index  # type: ignore[union-attr]
        if kind is Usage:
            usage: Usage = event  # type: ignore[assignment]
            self.usage = usage
            self.output_tokens = usage.completion_tokens
            if not self._include_usage:
                return b""
            return self._usage + _dumps(usage.as_dict()) + b"}\n\n"
        return b""  # the head: already part of every chunk

    def _choice(self, delta: ChoiceDelta) -> dict[str, Any]:
        if self._chat:
            return {
                "index": delta.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": delta.logprobs,
                "finish_reason": delta.finish_reason,
            }
        return {
            "index": delta.index,
            "text": delta.text,
            "logprobs": delta.logprobs,
            "finish_reason": delta.finish_reason,
        }

    @staticmethod
    def _rich_choice(delta: RichDelta) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if delta.reasoning:
            fields["reasoning_content"] = delta.reasoning
        if delta.text:
            fields["content"] = delta.text
        if delta.tool_call is not None:
            fields["tool_calls"] = [_tool_call(delta.tool_call)]
        return {
            "index": delta.index,
            "delta": fields,
            "logprobs": delta.logprobs,
            "finish_reason": delta.finish_reason,
        }


def _tool_call(call: ToolCallDelta) -> dict[str, Any]:
    """One ``delta.tool_calls`` entry: the first piece of a call (it has an id or a name)
    names it and says ``type``; a fragment carries only its index and arguments."""
    if call.id is None and call.name is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    entry: dict[str, Any] = {"index": call.index}
    if call.id is not None:
        entry["id"] = call.id
    entry["type"] = "function"
    function: dict[str, str] = {}
    if call.name is not None:
        function["name"] = call.name
    function["arguments"] = call.arguments
    entry["function"] = function
    return entry


def stream_chunks(events: Iterable[OpenAIEvent], *, include_usage: bool) -> list[dict[str, Any]]:
    """The chunk objects a streaming client receives for ``events`` (tests, debugging).

    Raises:
        ValueError: the events do not start with a :class:`~.events.ResponseHead`.
    """
    chunks: list[dict[str, Any]] = []
    renderer: SseRenderer | None = None
    for event in events:
        if renderer is None:
            if not isinstance(event, ResponseHead):
                raise ValueError("a response's events start with a ResponseHead")
            renderer = SseRenderer(event, include_usage=include_usage)
            continue
        data = renderer.render(event)
        if data:
            chunks.append(orjson.loads(data.removeprefix(b"data: ")))
    if renderer is None:
        raise ValueError("a response's events start with a ResponseHead")
    return chunks
