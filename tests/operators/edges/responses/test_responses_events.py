"""The Responses edge's backward half, judged by the ``openai`` SDK's own types and stream
accumulator.

For random parser releases (reasoning, content, tool calls, cut at random token
boundaries: :mod:`output_scripts`), the events a stream writes must each validate as one
of the SDK's ``ResponseStreamEvent`` s, carry ``sequence_number`` 0, 1, 2, ..., open every
item before its deltas and close it after, and the SDK's ``ResponseStreamState``, fed
those events, must assemble exactly the response the non-streamed path returns (validated
as a ``Response``), which must say what the script said.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib._parsing._responses import parse_response
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from operators.contracts.llm import BackendOutput, ToolCallDelta
from operators.edges.http.failures import ApiError
from operators.edges.openai.chunks import ChatChunks
from operators.edges.openai.events import OpenAIEvent, RichDelta
from operators.edges.responses.render import ResponseRenderer
from tests.helpers.output_scripts import TEXTS, Script, outputs_of, scripts

EVENT = TypeAdapter(ResponseStreamEvent)
SHELL: dict[str, Any] = {
    "id": "resp_0123456789abcdef0123456789abcdef",
    "object": "response",
    "created_at": 1700000000,
    "model": "m",
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "metadata": {},
    "temperature": 1.0,
    "top_p": 1.0,
    "text": {"format": {"type": "text"}},
}


def events_of(outputs: list[BackendOutput], *, logprobs: bool) -> list[OpenAIEvent]:
    chunks = ChatChunks(
        model="m", logprobs=1 if logprobs else None, texts=TEXTS, request_id="1", prompt_tokens=3
    )
    events: list[OpenAIEvent] = [chunks.head]
    for output in outputs:
        events += chunks.feed(output)
    events.append(chunks.usage(3, cached_tokens=1))
    return events


def sse(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data object) of every server-sent event in ``data``."""
    found = []
    for block in data.split(b"\n\n"):
        if not block:
            continue
        name_line, data_line = block.split(b"\n")
        assert name_line.startswith(b"event: ")
        assert data_line.startswith(b"data: ")
        found.append((name_line[7:].decode(), orjson.loads(data_line[6:])))
    return found


def streamed(events: list[OpenAIEvent], *, logprobs: bool) -> tuple[bytes, dict[str, Any]]:
    renderer = ResponseRenderer(dict(SHELL), stream=True, logprobs=logprobs)
    data = b"".join(renderer.render(event) for event in events)
    response = renderer.finished()
    return data + renderer.terminal(response), response


def whole(events: list[OpenAIEvent], *, logprobs: bool) -> dict[str, Any]:
    renderer = ResponseRenderer(dict(SHELL), stream=False, logprobs=logprobs)
    for event in events:
        assert renderer.render(event) == b""
    return renderer.finished()


def comparable(response: Response) -> dict[str, Any]:
    """The response without ``completed_at`` (the clock's, not the events')."""
    return {**response.model_dump(), "completed_at": None}


def check_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Sequence numbers count up from 0; each item is added, filled, then done."""
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [name for name, data in events] == [data["type"] for _, data in events]
    assert events[0][0] == "response.created"
    assert events[1][0] == "response.in_progress"
    assert events[-1][0] in ("response.completed", "response.incomplete")
    open_items: set[int] = set()
    done: set[int] = set()
    for name, data in events[2:-1]:
        index = data["output_index"]
        if name == "response.output_item.added":
            assert index not in open_items | done
            open_items.add(index)
        elif name == "response.output_item.done":
            open_items.remove(index)
            done.add(index)
        else:
            assert index in open_items, f"{name} outside its item"
    assert not open_items


@settings(max_examples=300, deadline=None)
@given(st.data(), st.booleans())
def test_streamed_events_assemble_to_the_whole_response(
    data: st.DataObject, logprobs: bool
) -> None:
    script: Script = data.draw(scripts(0))
    outputs = data.draw(outputs_of(script, 0, logprobs))
    events = events_of(outputs, logprobs=logprobs)
    stream, response = streamed(events, logprobs=logprobs)
    written = sse(stream)
    check_order(written)
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for _, event in written:
        state.handle_event(EVENT.validate_python(event))
    whole_response = Response.model_validate(whole(events, logprobs=logprobs))
    if response["status"] == "completed":
        assembled = state._completed_response
        assert assembled is not None
        parsed = parse_response(text_format=omit, input_tools=omit, response=whole_response)
        assert comparable(assembled) == comparable(parsed)
    else:  # the SDK only finalizes completed responses: compare the incomplete event's
        final = Response.model_validate(written[-1][1]["response"])
        assert comparable(final) == comparable(whole_response)
        assert whole_response.incomplete_details is not None
        assert whole_response.incomplete_details.reason == "max_output_tokens"
    # ... and it says what the script said
    texts = [
        part.text
        for item in whole_response.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    ]
    reasoning = [
        part.text
        for item in whole_response.output
        if item.type == "reasoning"
        for part in item.content or ()
    ]
    calls = [
        (item.call_id, item.name, item.arguments)
        for item in whole_response.output
        if item.type == "function_call"
    ]
    assert "".join(texts) == script.content
    assert "".join(reasoning) == script.reasoning
    assert calls == script.calls
    assert whole_response.status == ("incomplete" if script.finish == "length" else "completed")
    assert whole_response.output_text == script.content
    usage = whole_response.usage
    assert usage is not None
    assert usage.output_tokens == sum(len(o.token_ids) for o in outputs)
    assert usage.input_tokens == 3
    assert usage.input_tokens_details.cached_tokens == 1
    if logprobs:  # every token of a text output is delivered with it
        entries = [
            e
            for item in whole_response.output
            if item.type == "message"
            for p in item.content
            if p.type == "output_text"
            for e in p.logprobs or ()
        ]
        text_tokens = sum(
            len(o.token_ids) for o in outputs if o.text and not o.reasoning and not o.tool_calls
        )
        assert len(entries) >= text_tokens


def test_a_failure_closes_the_open_item_and_ends_with_response_failed() -> None:
    renderer = ResponseRenderer(dict(SHELL), stream=True, logprobs=False)
    chunks = ChatChunks(model="m", logprobs=None, texts=TEXTS, request_id="1")
    data = renderer.render(chunks.head)
    for event in chunks.feed(BackendOutput([1], ["Hi"], "Hi")):
        data += renderer.render(event)
    data += renderer.failure(ApiError("unavailable", "the worker was lost"))
    written = sse(data)
    names = [name for name, _ in written]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    failed = Response.model_validate(written[-1][1]["response"])
    assert failed.status == "failed"
    assert failed.error is not None
    assert failed.error.message == "the worker was lost"
    assert failed.output[0].type == "message"
    assert failed.output[0].status == "incomplete"


def test_reasoning_then_a_call_are_two_items_in_order() -> None:
    outputs = [
        BackendOutput([1], [""], "", reasoning="Think."),
        BackendOutput([2], [""], "", tool_calls=[ToolCallDelta(0, "", "call_a", "now")]),
        BackendOutput([3], [""], "", tool_calls=[ToolCallDelta(0, "{}")]),
        BackendOutput([], [], "", finish_reason="tool_calls"),
    ]
    response = whole(events_of(outputs, logprobs=False), logprobs=False)
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"]
    call = response["output"][1]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "call_a",
        "now",
        "{}",
        "completed",
    )
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 1
    assert any(isinstance(e, RichDelta) for e in events_of(outputs, logprobs=False))
