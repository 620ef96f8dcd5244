"""The graph's events as one Anthropic message: :class:`MessageRenderer`.

The backward half of the Anthropic edge: the graph's chat-shaped events
(:mod:`operators.edges.openai.events`) fold into content blocks, in the order they happen::

    reasoning text  -> a "thinking" block   (content_block_delta: thinking_delta)
    content text    -> a "text" block       (content_block_delta: text_delta)
    a tool call     -> a "tool_use" block   (content_block_delta: input_json_delta)

Streamed: ``message_start`` (with the prompt's tokens as ``input_tokens``), ``ping``, per
block ``content_block_start`` / ``content_block_delta`` ... / ``content_block_stop``, then
``message_delta`` (``stop_reason``, ``stop_sequence``, the final ``usage``) and
``message_stop``. Text and thinking follow each other (a new one stops the open one); a
tool_use block stays open until the answer ends, since its arguments may follow other
text. Whole, the same transitions give the same blocks (one code path), so a stream
assembles to exactly the non-streamed message.

``stop_reason``: ``max_tokens`` when the output limit cut the answer, ``tool_use`` when it
called a tool, ``stop_sequence`` (with ``stop_sequence`` set) when one of the request's
``stop_sequences`` ended it, ``end_turn`` otherwise. ``usage.input_tokens`` counts the
prompt tokens the engine computed, ``cache_read_input_tokens`` those it found cached (their
sum is the prompt, what ``count_tokens`` says), as Anthropic's API reports them.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import orjson

from operators.edges.openai.events import (
    ChoiceDelta,
    ChoiceStart,
    OpenAIEvent,
    ResponseHead,
    RichDelta,
    Usage,
)

__all__ = ("PING", "MessageRenderer", "tool_use_id")

_dumps = orjson.dumps
_Kind = Literal["text", "thinking"]
#: what a quiet stream writes to show it is alive (Anthropic's own keep-alive event)
PING: Final = b'event: ping\ndata: {"type":"ping"}\n\n'


def tool_use_id(call_id: str) -> str:
    """A tool-call parser's call id as Anthropic spells tool-use ids (``toolu_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def _sse(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _dumps(data) + b"\n\n"


class MessageRenderer:
    """One message's content blocks, and (streamed) its server-sent events.

    Args:
        message_id: ``msg_...``.
        model: the model named in the message.
        stop_sequences: the request's (a stop string that is one of them is a
            ``stop_sequence`` stop).
        stream: render bytes (False: only fold the events into blocks).
    """

    __slots__ = (
        "_block",
        "_calls",
        "_finish",
        "_kind",
        "_parts",
        "_stop_reason",
        "_stops",
        "_stream",
        "_text_template",
        "content",
        "message_id",
        "model",
        "usage",
    )

    def __init__(
        self, message_id: str, model: str, *, stop_sequences: tuple[str, ...], stream: bool
    ) -> None:
        self.message_id = message_id
        self.model = model
        #: the content blocks so far (the last may be open)
        self.content: list[dict[str, Any]] = []
        #: the graph's token counts, once they went by
        self.usage: Usage | None = None
        self._stops = stop_sequences
        self._stream = stream
        self._kind: _Kind | None = None  # the open text or thinking block's kind
        self._block: dict[str, Any] = {}  # ... the block
        self._parts: list[str] = []  # ... its text so far
        #: open tool_use blocks by the choice's call index: (block index, block, arguments)
        self._calls: dict[int, tuple[int, dict[str, Any], list[str]]] = {}
        self._text_template = b""
        self._finish: str | None = None
        self._stop_reason: str | int | None = None

    # ------------------------------------------------------------------------ results

    @property
    def stop(self) -> tuple[str, str | None]:
        """(``stop_reason``, ``stop_sequence``)."""
        finish, why = self._finish, self._stop_reason
        if finish == "length":
            return "max_tokens", None
        if finish == "tool_calls":
            return "tool_use", None
        if isinstance(why, str) and why in self._stops:
            return "stop_sequence", why
        return "end_turn", None

    def usage_object(self) -> dict[str, int]:
        """Anthropic's ``usage``: computed and cached prompt tokens apart."""
        usage = self.usage
        if usage is None:
            return {"input_tokens": 0, "output_tokens": 0}
        cached = min(usage.cached_tokens or 0, usage.prompt_tokens)
        return {
            "input_tokens": usage.prompt_tokens - cached,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def finished(self) -> dict[str, Any]:
        """The whole message, once every event went by."""
        self._close_all()
        stop_reason, stop_sequence = self.stop
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage_object(),
        }

    def tail(self) -> bytes:
        """The stream's last events: ``message_delta`` and ``message_stop``."""
        closing = self._close_all()
        stop_reason, stop_sequence = self.stop
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": self.usage_object(),
        }
        return (
            closing + _sse("message_delta", delta) + _sse("message_stop", {"type": "message_stop"})
        )

    # ------------------------------------------------------------------------ events

    def render(self, event: OpenAIEvent) -> bytes:
        """The server-sent events for one of the graph's events (b"" when none)."""
        kind = type(event)
        if kind is ChoiceDelta and self._kind == "text":
            delta: ChoiceDelta = event  # type: ignore[assignment]
            text = delta.text
            if text and delta.finish_reason is None:
                self._parts.append(text)  # the common case: one more piece of text
                return self._text_template % _dumps(text) if self._stream else b""
        if kind is ChoiceDelta or kind is RichDelta:
            return self._delta(event)  # type: ignore[arg-type]
        if kind is Usage:
            self.usage = event  # type: ignore[assignment]
            return b""
        if kind is ResponseHead:
            head: ResponseHead = event  # type: ignore[assignment]
            if not self._stream:
                return b""
            message: dict[str, Any] = {
                "id": self.message_id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": head.prompt_tokens or 0,
                    "output_tokens": 0,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                },
            }
            return _sse("message_start", {"type": "message_start", "message": message}) + PING
        if kind is ChoiceStart:
            return b""
        raise TypeError(f"not an event of the graph: {type(event).__name__}")

    def _delta(self, delta: ChoiceDelta) -> bytes:
        if delta.index != 0:  # (one answer per message)
            return b""
        out: list[bytes] = []
        rich = delta if isinstance(delta, RichDelta) else None
        if rich is not None and rich.reasoning:
            if self._kind != "thinking":
                out.append(self._open("thinking"))
            self._parts.append(rich.reasoning)
            out.append(self._piece({"type": "thinking_delta", "thinking": rich.reasoning}))
        if delta.text:
            if self._kind != "text":
                out.append(self._open("text"))
            self._parts.append(delta.text)
            out.append(self._piece({"type": "text_delta", "text": delta.text}))
        call = rich.tool_call if rich is not None else None
        if call is not None:
            if call.id is not None or call.name is not None:
                out.append(self._open_call(call.index, tool_use_id(call.id or ""), call.name))
            opened = self._calls.get(call.index)
            if call.arguments and opened is not None:
                opened[2].append(call.arguments)
                piece = {"type": "input_json_delta", "partial_json": call.arguments}
                out.append(self._piece(piece, opened[0]))
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
            self._stop_reason = delta.stop_reason
            out.append(self._close_all())
        return b"".join(out)

    def _piece(self, delta: dict[str, Any], index: int | None = None) -> bytes:
        """A content_block_delta of the open text or thinking block (the last block), or
        of block ``index``."""
        if not self._stream:
            return b""
        at = len(self.content) - 1 if index is None else index
        event = {"type": "content_block_delta", "index": at, "delta": delta}
        return _sse("content_block_delta", event)

    # ------------------------------------------------------------------------ blocks

    def _open(self, kind: Literal["text", "thinking"]) -> bytes:
        """Stop the open text or thinking block; open one of ``kind`` (the last block)."""
        closed = self._close()
        index = len(self.content)
        block: dict[str, Any]
        if kind == "text":
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        self.content.append(block)
        self._kind, self._block, self._parts = kind, block, []
        if not self._stream:
            return closed
        if kind == "text":
            self._text_template = (
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                + b"%d" % index
                + b',"delta":{"type":"text_delta","text":%s}}\n\n'
            )
        return closed + self._start(index, block)

    def _open_call(self, call_index: int, block_id: str, name: str | None) -> bytes:
        """Stop the open text or thinking block (what was said before the call); start a
        tool_use block, open until the answer ends."""
        closed = self._close()
        index = len(self.content)
        block: dict[str, Any] = {"type": "tool_use", "id": block_id, "name": name, "input": {}}
        self.content.append(block)
        self._calls[call_index] = (index, block, [])
        return closed + self._start(index, block) if self._stream else closed

    def _start(self, index: int, block: dict[str, Any]) -> bytes:
        start = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return _sse("content_block_start", start)

    def _close(self) -> bytes:
        """Stop the open text or thinking block; b"" when none is open."""
        kind = self._kind
        if kind is None:
            return b""
        self._kind = None
        self._block[kind] = "".join(self._parts)
        return self._stop(len(self.content) - 1)

    def _close_all(self) -> bytes:
        """Stop the open text or thinking block, then every open tool_use block, in order."""
        out = [self._close()]
        for index, block, parts in sorted(self._calls.values(), key=lambda call: call[0]):
            block["input"] = _arguments("".join(parts))
            out.append(self._stop(index))
        self._calls.clear()
        return b"".join(out)

    def _stop(self, index: int) -> bytes:
        if not self._stream:
            return b""
        return _sse("content_block_stop", {"type": "content_block_stop", "index": index})


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as a tool_use block's ``input`` object."""
    if not text:
        return {}
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}
