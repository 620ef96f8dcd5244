"""Reasoning and tool calls on the OpenAI layer's backward edge, checked by the ``openai`` SDK.

The BackendOutputs a parser produces (``reasoning``, ``tool_calls``) become chat events
(:class:`RichDelta`), which render as streamed chunks and fold into a non-streamed
response. The official client's own types are the judge: every chunk validates as a
``ChatCompletionChunk``, the SDK's stream accumulator (``ChatCompletionStreamState``)
reassembles them, and the result equals :func:`aggregate_chat` of the same events
validated as a ``ChatCompletion``, and the script the outputs were cut from, on random
cuts of reasoning, content and several calls, with n>1 choices interleaved. A content-only
delta still renders through the text template.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from operators.contracts.llm import BackendOutput, ToolCallDelta
from operators.edges.openai.chunks import ChatChunks, CompletionChunks
from operators.edges.openai.events import (
    ChoiceDelta,
    ChoiceStart,
    OpenAIEvent,
    RichDelta,
    aggregate_chat,
)
from operators.edges.openai.sse import SseRenderer, is_visible, stream_chunks
from tests.helpers.output_scripts import HEAD, TEXTS, Script, responses


def events_of(outputs: list[BackendOutput], *, logprobs: bool) -> list[OpenAIEvent]:
    chunks = ChatChunks(model="m", logprobs=1 if logprobs else None, texts=TEXTS, request_id="1")
    events: list[OpenAIEvent] = [chunks.head]
    for output in outputs:
        events += chunks.feed(output)
    events.append(chunks.usage(3))
    return events


def message_view(message: Any, finish: str | None) -> dict[str, Any]:
    """What a client reads from a (streamed and accumulated, or whole) chat message."""
    return {
        "content": message.content or "",
        "reasoning": (message.model_extra or {}).get("reasoning_content") or "",
        "calls": [
            (call.id, call.function.name, call.function.arguments)
            for call in message.tool_calls or ()
        ],
        "finish": finish,
    }


def check_chunk_shapes(chunks: list[dict[str, Any]]) -> None:
    """One payload per delta; a call's first piece names it, its fragments do not; each
    choice's finish_reason comes once, on its last chunk."""
    finishes: dict[int, list[str | None]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
            delta = choice["delta"]
            calls = delta.get("tool_calls")
            if calls is not None:
                [call] = calls
                assert "content" not in delta
                assert "reasoning_content" not in delta
                if "id" in call:
                    assert call["type"] == "function"
                    assert set(call["function"]) == {"name", "arguments"}
                else:
                    assert set(call) == {"index", "function"}
                    assert set(call["function"]) == {"arguments"}
            if "reasoning_content" in delta:
                assert "content" not in delta
    for reasons in finishes.values():
        assert reasons[-1] is not None
        assert reasons[:-1] == [None] * (len(reasons) - 1)


@settings(max_examples=300, deadline=None)
@given(responses(), st.booleans())
def test_streamed_chunks_reassemble_to_the_whole_response(
    response: tuple[list[Script], list[BackendOutput], bool], include_usage: bool
) -> None:
    scripts_, outputs, logprobs = response
    events = events_of(outputs, logprobs=logprobs)
    chunks = stream_chunks(events, include_usage=include_usage)
    check_chunk_shapes(chunks)
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    # the accumulated snapshot: get_final_completion() refuses a "length" finish
    streamed = state.current_completion_snapshot
    whole = ChatCompletion.model_validate(aggregate_chat(events))

    assert len(streamed.choices) == len(whole.choices) == len(scripts_)
    for index, script in enumerate(scripts_):
        expected = {
            "content": script.content,
            "reasoning": script.reasoning,
            "calls": script.calls,
            "finish": script.finish,
        }
        got_streamed, got_whole = streamed.choices[index], whole.choices[index]
        assert got_streamed.index == got_whole.index == index
        assert message_view(got_streamed.message, got_streamed.finish_reason) == expected
        assert message_view(got_whole.message, got_whole.finish_reason) == expected
        # content is None only for a reply that called tools and said nothing
        assert (got_whole.message.content is None) == (bool(script.calls) and not script.content)
        if logprobs:  # every token delivered: one entry per token, whichever chunk carried it
            tokens = sum(len(o.token_ids) for o in outputs if o.index == index)
            assert got_whole.logprobs is not None
            assert got_streamed.logprobs is not None
            assert got_whole.logprobs.content is not None
            assert len(got_whole.logprobs.content) == tokens
            assert got_streamed.logprobs.content == got_whole.logprobs.content
        else:
            assert got_whole.logprobs is None


def test_a_call_streams_as_openai_streams_it() -> None:
    outputs = [
        BackendOutput([1], [""], "", reasoning="Think."),
        BackendOutput([2], [""], "Sure.", tool_calls=[ToolCallDelta(0, "", "call_a", "now")]),
        BackendOutput([3], [""], "", tool_calls=[ToolCallDelta(0, "{}")]),
        BackendOutput([], [], "", finish_reason="tool_calls"),
    ]
    chunks = stream_chunks(events_of(outputs, logprobs=False), include_usage=False)
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ({"role": "assistant", "content": ""}, None),
        ({"reasoning_content": "Think."}, None),
        ({"content": "Sure."}, None),
        (
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "now", "arguments": ""},
                    }
                ]
            },
            None,
        ),
        ({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, None),
        ({}, "tool_calls"),
    ]
    [choice] = aggregate_chat(events_of(outputs, logprobs=False))["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "Think.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        ],
    }
    assert choice["finish_reason"] == "tool_calls"


def test_one_output_splits_into_one_delta_per_payload() -> None:
    """Reasoning, content, then each call piece; logprobs on the first, finish on the last."""
    output = BackendOutput(
        [1, 2],
        ["a", "b"],
        "text",
        [-0.1, -0.2],
        None,
        "tool_calls",
        None,
        0,
        2,
        "why",
        [ToolCallDelta(0, '{"a": 1}', "call_0", "f"), ToolCallDelta(1, "", "call_1", "g")],
    )
    chunks = ChatChunks(model="m", logprobs=0, texts=TEXTS, request_id="1")
    start, *events = chunks.feed(output)
    assert start == ChoiceStart(0)
    deltas = [event for event in events if isinstance(event, ChoiceDelta)]
    assert [type(delta) for delta in deltas] == [RichDelta, ChoiceDelta, RichDelta, RichDelta]
    assert deltas[0].logprobs is not None
    assert len(deltas[0].logprobs["content"]) == 2
    assert all(delta.logprobs is None for delta in deltas[1:])
    assert [delta.finish_reason for delta in deltas] == [None, None, None, "tool_calls"]
    assert chunks.feed(BackendOutput([3], [""], "late", reasoning="late")) == []  # finished


def test_a_plain_answer_keeps_the_plain_shape() -> None:
    """No reasoning, no calls: no RichDelta, and no new keys in the message."""
    outputs = [BackendOutput([1], [""], "Hi"), BackendOutput([2], [""], "!", finish_reason="stop")]
    events = events_of(outputs, logprobs=False)
    assert not any(isinstance(event, RichDelta) for event in events)
    [choice] = aggregate_chat(events)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hi!"}


def test_completions_ignore_reasoning_and_calls() -> None:
    chunks = CompletionChunks(model="m", logprobs=None, texts=TEXTS)
    output = BackendOutput(
        [1], [""], "x", reasoning="r", tool_calls=[ToolCallDelta(0, "", "c", "f")]
    )
    assert chunks.feed(output) == [ChoiceDelta(0, "x")]


def _no_general_path(*args: Any) -> Any:
    raise AssertionError("rendered through the general path")


@pytest.mark.parametrize("include_usage", [False, True])
def test_content_and_reasoning_deltas_take_the_templates(
    monkeypatch: pytest.MonkeyPatch, include_usage: bool
) -> None:
    """The templates' JSON is the general path's, and the general path is not taken."""
    renderer = SseRenderer(HEAD, include_usage=include_usage)
    text, reasoning = ChoiceDelta(1, 'a "quoted" é %s'), RichDelta(1, "", None, None, "hmm %d")
    finished = ChoiceDelta(1, 'a "quoted" é %s', None, "stop")
    general = orjson.loads(renderer.render(finished).removeprefix(b"data: "))
    general["choices"][0]["finish_reason"] = None
    reasoning_choice = SseRenderer._rich_choice(reasoning)
    assert reasoning_choice["delta"] == {"reasoning_content": "hmm %d"}
    monkeypatch.setattr(SseRenderer, "_choice", _no_general_path)
    monkeypatch.setattr(SseRenderer, "_rich_choice", _no_general_path)
    assert orjson.loads(renderer.render(text).removeprefix(b"data: ")) == general
    chunk = orjson.loads(renderer.render(reasoning).removeprefix(b"data: "))
    assert chunk == {**general, "choices": [reasoning_choice]}
    ChatCompletionChunk.model_validate(chunk)
    with pytest.raises(AssertionError, match="general path"):
        renderer.render(RichDelta(1, "", None, None, "", ToolCallDelta(0, "{")))


def test_reasoning_and_calls_commit_the_response() -> None:
    assert is_visible(RichDelta(0, "", None, None, "thinking"))
    assert is_visible(RichDelta(0, "", None, None, "", ToolCallDelta(0, "", "c", "f")))
    assert is_visible(ChoiceDelta(0, "text"))
    assert not is_visible(RichDelta(0, "", None, "stop"))
    assert not is_visible(ChoiceDelta(0, "", None, "stop"))
    assert not is_visible(ChoiceStart(0))
