"""The graph's events as one Responses API response: :class:`ResponseRenderer`.

The backward half of the Responses edge. The graph yields chat-shaped events
(:mod:`operators.edges.openai.events`): a head, content deltas, reasoning and tool-call
pieces (:class:`~operators.edges.openai.events.RichDelta`), finish reasons, a usage. This
module folds them into the Responses API's *output items*, in the order they happen::

    reasoning text   -> a "reasoning" item      (response.reasoning_text.delta ...)
    content text     -> a "message" item        (response.output_text.delta ...)
    a tool call      -> a "function_call" item  (response.function_call_arguments.delta ...)

A reasoning item's ``content`` is what the model reasoned, whole (``reasoning_text``); its
``summary`` stays empty whatever ``reasoning.summary`` asked: no summary is made, and the
model's own reasoning is not one. Text and reasoning follow each other: a new one closes
the open one. A call's item stays
open until the answer ends (its arguments may come after other text), and the finish
closes them all (``incomplete`` when ``max_output_tokens`` cut the answer). Streamed, every
step is a server-sent event with an increasing ``sequence_number``: ``response.created``,
``response.in_progress``, per item ``response.output_item.added``,
``response.content_part.added``, the deltas, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, and at the end
``response.completed`` or ``response.incomplete`` (``response.failed`` for a failure).
Whole, the same transitions build the same items (one code path: the renderer in
``stream=False`` mode renders no bytes), so a stream's deltas assemble to exactly the
non-streamed response. A content delta, nearly every token, is one ``bytes %`` of a
template prepared when its message item opened.

Logprobs (``include: ["message.output_text.logprobs"]``) ride on the text deltas and are
collected on the output text; those an output carried on a reasoning or call piece belong
to no output text and are left out.
"""

from __future__ import annotations

import time
from typing import Any, Final, Literal

import orjson

from operators.edges.http.failures import ApiError
from operators.edges.openai.events import (
    ChoiceDelta,
    ChoiceStart,
    OpenAIEvent,
    ResponseHead,
    RichDelta,
    Usage,
)

__all__ = ("ResponseRenderer", "failed_code", "usage_object")

_dumps = orjson.dumps
_Kind = Literal["message", "reasoning", "function_call"]
#: item id prefixes, as OpenAI's
_PREFIX: Final[dict[_Kind, str]] = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def usage_object(usage: Usage | None) -> dict[str, Any] | None:
    """The Responses API's ``usage`` for the graph's :class:`Usage`."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens or 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def failed_code(error: ApiError) -> str:
    """The ``response.error.code`` of a failed response."""
    if error.kind == "invalid_request":
        return "invalid_prompt"
    if error.kind == "overloaded":
        return "rate_limit_exceeded"
    return "server_error"


class _Call:
    """An open function_call item: its place, and its arguments so far."""

    __slots__ = ("index", "item", "parts")

    def __init__(self, index: int, item: dict[str, Any]) -> None:
        self.index = index
        self.item = item
        self.parts: list[str] = []


class ResponseRenderer:
    """One response's output items, and (streamed) its server-sent events.

    Args:
        response: the response object without output, status or usage (its ``id``,
            ``model``, the request's settings), as every event repeats it.
        stream: render bytes (False: only fold the events into items).
        logprobs: collect the output text's logprobs.
    """

    __slots__ = (
        "_calls",
        "_finish",
        "_hex",
        "_index",
        "_item",
        "_kind",
        "_logprobs",
        "_parts",
        "_seq",
        "_stream",
        "_text_template",
        "_token_logprobs",
        "output",
        "response",
        "usage",
    )

    def __init__(self, response: dict[str, Any], *, stream: bool, logprobs: bool) -> None:
        self.response = response
        #: the finished and open output items, in order
        self.output: list[dict[str, Any]] = []
        #: the graph's token counts, once they went by
        self.usage: Usage | None = None
        self._hex = str(response["id"]).removeprefix("resp_")
        self._stream = stream
        self._logprobs = logprobs
        self._seq = 0
        self._kind: _Kind | None = None  # the open text or reasoning item's kind
        self._item: dict[str, Any] = {}  # ... the item
        self._index = 0  # ... its output index
        self._parts: list[str] = []  # ... its text so far
        self._token_logprobs: list[Any] = []
        self._text_template = b""
        self._calls: dict[int, _Call] = {}  # open calls, by the choice's call index
        self._finish: str | None = None

    # ------------------------------------------------------------------------ results

    @property
    def status(self) -> Literal["completed", "incomplete"]:
        """``incomplete`` when ``max_output_tokens`` (or the context) cut the answer."""
        return "incomplete" if self._finish == "length" else "completed"

    def finished(self) -> dict[str, Any]:
        """The whole response, once every event went by (the open items closed)."""
        self._close_all()
        incomplete = self.status == "incomplete"
        return {
            **self.response,
            "status": self.status,
            "completed_at": int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": self.output,
            "usage": usage_object(self.usage),
        }

    def terminal(self, response: dict[str, Any]) -> bytes:
        """The stream's last event for the finished ``response``."""
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, {"response": response})

    def failure(self, error: ApiError) -> bytes:
        """``response.failed``: the output so far (the open items ``incomplete``), and
        what went wrong."""
        closing = self._close_all("incomplete")
        response = {
            **self.response,
            "status": "failed",
            "error": {"code": failed_code(error), "message": error.message},
            "output": self.output,
            "usage": usage_object(self.usage),
        }
        return closing + self._event("response.failed", {"response": response})

    # ------------------------------------------------------------------------ events

    def render(self, event: OpenAIEvent) -> bytes:
        """The server-sent events for one of the graph's events (b"" when none)."""
        kind = type(event)
        if kind is ChoiceDelta and self._kind == "message":
            delta: ChoiceDelta = event  # type: ignore[assignment]
            text = delta.text
            if text and delta.logprobs is None and delta.finish_reason is None:
                self._parts.append(text)  # the common case: one more piece of text
                if not self._stream:
                    return b""
                seq = self._seq
                self._seq = seq + 1
                return self._text_template % (seq, _dumps(text))
        if kind is ChoiceDelta or kind is RichDelta:
            return self._delta(event)  # type: ignore[arg-type]
        if kind is Usage:
            self.usage = event  # type: ignore[assignment]
            return self._close_all()
        if kind is ResponseHead:
            snapshot = {**self.response, "status": "in_progress", "output": [], "usage": None}
            return self._event("response.created", {"response": snapshot}) + self._event(
                "response.in_progress", {"response": snapshot}
            )
        if kind is ChoiceStart:
            return b""
        raise TypeError(f"not an event of the graph: {type(event).__name__}")

    def _delta(self, delta: ChoiceDelta) -> bytes:
        if delta.index != 0:  # (n > 1 is refused at the edge: one answer per response)
            return b""
        out: list[bytes] = []
        rich = delta if isinstance(delta, RichDelta) else None
        if rich is not None and rich.reasoning:
            if self._kind != "reasoning":
                out.append(self._open("reasoning"))
            self._parts.append(rich.reasoning)
            out.append(self._event("response.reasoning_text.delta", self._at(rich.reasoning)))
        if delta.text:
            if self._kind != "message":
                out.append(self._open("message"))
            self._parts.append(delta.text)
            fields = self._at(delta.text)
            entries: list[Any] = []
            if self._logprobs and delta.logprobs is not None:
                entries = delta.logprobs["content"]
                self._token_logprobs.extend(entries)
            fields["logprobs"] = entries
            out.append(self._event("response.output_text.delta", fields))
        call = rich.tool_call if rich is not None else None
        if call is not None:
            if call.id is not None or call.name is not None:
                out.append(self._open_call(call.index, call.id, call.name))
            opened = self._calls.get(call.index)
            if call.arguments and opened is not None:
                opened.parts.append(call.arguments)
                fields = {
                    "item_id": opened.item["id"],
                    "output_index": opened.index,
                    "delta": call.arguments,
                }
                out.append(self._event("response.function_call_arguments.delta", fields))
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
            out.append(self._close_all())
        return b"".join(out)

    def _at(self, delta: str) -> dict[str, Any]:
        return {
            "item_id": self._item["id"],
            "output_index": self._index,
            "content_index": 0,
            "delta": delta,
        }

    # ------------------------------------------------------------------------ items

    def _added(self, kind: _Kind, **fields: Any) -> tuple[int, dict[str, Any], bytes]:
        """A new item of ``kind`` at the end of the output: (index, item, added event)."""
        index = len(self.output)
        item_id = f"{_PREFIX[kind]}_{self._hex}{index:04x}"
        item: dict[str, Any]
        if kind == "message":
            item = {
                "id": item_id,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        elif kind == "reasoning":
            item = {"id": item_id, "type": "reasoning", "summary": [], "content": []}
        else:
            item = {
                "id": item_id,
                "type": "function_call",
                "status": "in_progress",
                "call_id": fields["call_id"],
                "name": fields["name"],
                "arguments": "",
            }
        self.output.append(item)
        added = self._event("response.output_item.added", {"output_index": index, "item": item})
        return index, item, added

    def _open(self, kind: Literal["message", "reasoning"]) -> bytes:
        """Close the open text or reasoning item; open one of ``kind`` (its added events)."""
        closed = self._close()
        index, item, added = self._added(kind)
        self._kind, self._item, self._index = kind, item, index
        self._parts = []
        self._token_logprobs = []
        if not self._stream:
            return closed
        part: dict[str, Any]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._text_template = (
                b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                b'"sequence_number":%d,"item_id":'
                + _dumps(item["id"]).replace(b"%", b"%%")
                + b',"output_index":%d,' % index
                + b'"content_index":0,"delta":%s,"logprobs":[]}\n\n'
            )
        else:
            part = {"type": "reasoning_text", "text": ""}
        fields = {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part}
        return closed + added + self._event("response.content_part.added", fields)

    def _open_call(self, call_index: int, call_id: str | None, name: str | None) -> bytes:
        """Close the open text or reasoning item (what was said before the call); open the
        call's item, which stays open until the answer ends."""
        closed = self._close()
        index, item, added = self._added("function_call", call_id=call_id, name=name)
        self._calls[call_index] = _Call(index, item)
        return closed + added

    def _close(self, status: str | None = None) -> bytes:
        """Close the open text or reasoning item (its done events); b"" when none is."""
        kind = self._kind
        if kind is None:
            return b""
        self._kind = None
        item = self._item
        index = self._index
        text = "".join(self._parts)
        item["status"] = status or self._status()
        if kind == "message":
            logprobs = self._token_logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            done = {"text": text, "logprobs": logprobs}
            name = "response.output_text.done"
        else:
            part = {"type": "reasoning_text", "text": text}
            done = {"text": text}
            name = "response.reasoning_text.done"
        item["content"] = [part]
        if not self._stream:
            return b""
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return (
            self._event(name, {**at, **done})
            + self._event("response.content_part.done", {**at, "part": part})
            + self._event("response.output_item.done", {"output_index": index, "item": item})
        )

    def _close_all(self, status: str | None = None) -> bytes:
        """Close the open text or reasoning item, then every open call, in order."""
        out = [self._close(status)]
        for call in sorted(self._calls.values(), key=lambda call: call.index):
            item = call.item
            item["arguments"] = "".join(call.parts)
            item["status"] = status or self._status()
            if self._stream:
                fields = {
                    "item_id": item["id"],
                    "output_index": call.index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
                out.append(self._event("response.function_call_arguments.done", fields))
                done = {"output_index": call.index, "item": item}
                out.append(self._event("response.output_item.done", done))
        self._calls.clear()
        return b"".join(out)

    def _status(self) -> str:
        return "incomplete" if self._finish == "length" else "completed"

    def _event(self, name: str, fields: dict[str, Any]) -> bytes:
        """One server-sent event: ``event:`` its type, ``data:`` the object."""
        if not self._stream:
            return b""
        seq = self._seq
        self._seq = seq + 1
        data = _dumps({"type": name, "sequence_number": seq, **fields})
        return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"
