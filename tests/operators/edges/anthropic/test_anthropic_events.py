"""The Anthropic edge's backward half, judged by the ``anthropic`` SDK's own types and
stream accumulator.

For random parser releases (thinking, text, tool calls with JSON arguments cut anywhere,
a stop sequence or none), every streamed event must validate as one of the SDK's
``RawMessageStreamEvent`` s, and the SDK's ``accumulate_event``, fed them, must assemble
exactly the ``Message`` the non-streamed path returns, which must say what the script said.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from operators.contracts.llm import BackendOutput, FinishReason, ToolCallDelta
from operators.edges.anthropic.errors import error_event
from operators.edges.anthropic.render import PING, MessageRenderer, tool_use_id
from operators.edges.http.failures import ApiError
from operators.edges.openai.chunks import ChatChunks
from operators.edges.openai.events import OpenAIEvent
from tests.helpers.output_scripts import CUTS, TEXT, TEXTS, pieces

EVENT = TypeAdapter(RawMessageStreamEvent)
STOPS = ("END", "§§")


@st.composite
def releases(draw: st.DrawFn) -> tuple[dict[str, Any], list[BackendOutput]]:
    """What one answer says (thinking, text, calls) and its outputs, cut at random."""
    thinking = draw(TEXT)
    texts = draw(st.lists(TEXT, min_size=1, max_size=3))
    calls = [
        (f"call_{k}", draw(st.sampled_from(["get_weather", "now"])), {"q": draw(TEXT)})
        for k in range(draw(st.integers(0, 2)))
    ]
    atoms: list[Any] = [("reasoning", piece) for piece in pieces(thinking, draw(CUTS)) if piece]
    for k, (call_id, name, arguments) in enumerate(calls):
        if k < len(texts):
            atoms += [("content", piece) for piece in pieces(texts[k], draw(CUTS)) if piece]
        atoms.append(ToolCallDelta(k, "", call_id, name))
        text = orjson.dumps(arguments).decode()
        atoms += [ToolCallDelta(k, piece) for piece in pieces(text, draw(CUTS)) if piece]
    for text in texts[len(calls) :]:
        atoms += [("content", piece) for piece in pieces(text, draw(CUTS)) if piece]
    finish: FinishReason = "tool_calls" if calls else draw(st.sampled_from(["stop", "length"]))
    stop = draw(st.sampled_from([None, *STOPS])) if finish == "stop" else None
    ends = sorted(set(draw(st.lists(st.integers(1, max(len(atoms), 1)), max_size=len(atoms)))))
    groups = [atoms[a:b] for a, b in itertools.pairwise([0, *ends, len(atoms)])]
    outputs = []
    for number, group in enumerate(groups):
        last = number == len(groups) - 1
        outputs.append(
            BackendOutput(
                [100 + number],
                [""],
                "".join(a[1] for a in group if isinstance(a, tuple) and a[0] == "content"),
                finish_reason=finish if last else None,
                stop_reason=stop if last else None,
                delivered_tokens=number + 1,
                reasoning="".join(
                    a[1] for a in group if isinstance(a, tuple) and a[0] == "reasoning"
                ),
                tool_calls=[a for a in group if isinstance(a, ToolCallDelta)] or None,
            )
        )
    said = {
        "thinking": thinking,
        "text": "".join(a[1] for a in atoms if isinstance(a, tuple) and a[0] == "content"),
        "calls": [(tool_use_id(i), n, a) for i, n, a in calls],
        "finish": finish,
        "stop": stop,
    }
    return said, outputs


def events_of(outputs: list[BackendOutput]) -> list[OpenAIEvent]:
    chunks = ChatChunks(model="m", logprobs=None, texts=TEXTS, request_id="1", prompt_tokens=9)
    events: list[OpenAIEvent] = [chunks.head]
    for output in outputs:
        events += chunks.feed(output)
    events.append(chunks.usage(9, cached_tokens=4))
    return events


def sse(data: bytes) -> list[dict[str, Any]]:
    found = []
    for block in data.split(b"\n\n"):
        if block:
            name_line, data_line = block.split(b"\n")
            event = orjson.loads(data_line.removeprefix(b"data: "))
            assert name_line == b"event: " + event["type"].encode()
            found.append(event)
    return found


def renderer(stream: bool) -> MessageRenderer:
    return MessageRenderer("msg_1", "m", stop_sequences=STOPS, stream=stream)


@settings(max_examples=300, deadline=None)
@given(releases())
def test_streamed_events_assemble_to_the_whole_message(
    release: tuple[dict[str, Any], list[BackendOutput]],
) -> None:
    said, outputs = release
    events = events_of(outputs)
    streaming = renderer(stream=True)
    data = b"".join(streaming.render(event) for event in events) + streaming.tail()
    assert PING in data
    written = sse(data)
    assert written[0]["type"] == "message_start"
    assert [event["type"] for event in written[-2:]] == ["message_delta", "message_stop"]
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in written:
        if event["type"] == "ping":  # (the SDK's stream skips pings)
            continue
        snapshot = accumulate_event(
            event=EVENT.validate_python(event), current_snapshot=snapshot, json_bufs=json_bufs
        )
    whole = renderer(stream=False)
    for event in events:
        assert whole.render(event) == b""
    message = Message.model_validate(whole.finished())
    assert snapshot is not None
    assert Message.model_validate(snapshot.model_dump()) == message
    # ... and it says what the script said
    assert "".join(b.thinking for b in message.content if b.type == "thinking") == said["thinking"]
    assert "".join(b.text for b in message.content if b.type == "text") == said["text"]
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == said[
        "calls"
    ]
    expected = {"length": "max_tokens", "tool_calls": "tool_use"}.get(said["finish"])
    if expected is None:
        expected = "end_turn" if said["stop"] is None else "stop_sequence"
    assert message.stop_reason == expected
    assert message.stop_sequence == said["stop"]
    assert message.usage.input_tokens == 5
    assert message.usage.cache_read_input_tokens == 4
    assert message.usage.output_tokens == len(outputs)


def test_a_stop_string_not_asked_for_is_an_end_turn() -> None:
    """A stop the request did not name (a tool-call parser's) is not a stop_sequence."""
    whole = renderer(stream=False)
    outputs = [BackendOutput([1], [""], "Hi", finish_reason="stop", stop_reason="</x>")]
    for event in events_of(outputs):
        whole.render(event)
    assert whole.finished()["stop_reason"] == "end_turn"


def test_a_failed_stream_ends_with_an_error_event() -> None:
    event = sse(error_event(ApiError("overloaded", "busy"), "msg_1"))[0]
    assert event == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
        "request_id": "msg_1",
    }
