"""Truncation of a chat prompt (the Responses API's ``truncation: "auto"``), as properties:
whatever the conversation and the context, the prompt keeps its first messages, then the
longest run of the latest messages that fits, never starting with a tool result whose call
was dropped; and one message more would not have fit.

Tokens are characters here (an encoder of one id per character), so a prompt's size is the
length of its text and every case is exact.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from operators.edges.openai.chat_prompt import ChatPrompts
from operators.edges.openai.chat_template import ChatTemplate
from operators.edges.openai.protocol import ChatMessage
from operators.edges.responses.conversation import ResponsesChatRequest

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def encode(text: str) -> list[int]:
    return [ord(character) for character in text]


PROMPTS = ChatPrompts(ChatTemplate(TEMPLATE), ChatTemplate(TEMPLATE), encode)


def message(role: str, content: str) -> ChatMessage:
    return ChatMessage.model_construct(
        role=role, content=content, name=None, tool_calls=None, tool_call_id=None
    )


def request(messages: list[ChatMessage], keep: int, max_tokens: int | None) -> Any:
    return ResponsesChatRequest.model_construct(
        messages=messages, truncate_after=keep, max_tokens=max_tokens
    )


def rendered(messages: list[ChatMessage]) -> str:
    return "".join(f"<{m.role}>{m.content}" for m in messages)


def fits(size: int, context: int, max_tokens: int | None) -> bool:
    return size < context and (max_tokens is None or size + max_tokens <= context)


turns = st.lists(
    st.tuples(st.sampled_from(["user", "assistant", "tool"]), st.text("abc", max_size=30)),
    min_size=1,
    max_size=12,
)


def expected(
    head: list[ChatMessage], rest: list[ChatMessage], context: int, max_tokens: int | None
) -> list[ChatMessage]:
    """What truncation keeps, found the slow way: drop the oldest one at a time (and the
    tool results left leading) until it fits; at most all but the last."""
    if fits(len(rendered([*head, *rest])), context, max_tokens) or len(rest) <= 1:
        return [*head, *rest]
    for dropped in range(1, len(rest)):
        left = rest[dropped:]
        while len(left) > 1 and left[0].role == "tool":
            left = left[1:]
        if fits(len(rendered([*head, *left])), context, max_tokens):
            return [*head, *left]
    return [*head, *left]


@settings(max_examples=300, deadline=None)
@given(
    turns=turns,
    instructions=st.booleans(),
    context=st.integers(10, 300),
    max_tokens=st.none() | st.integers(1, 50),
)
def test_truncation_keeps_the_instructions_and_the_latest_that_fit(
    turns: list[tuple[str, str]], instructions: bool, context: int, max_tokens: int | None
) -> None:
    head = [message("system", "Rules.")] if instructions else []
    rest = [message(role, content) for role, content in turns]
    prompt = PROMPTS.prompt(request([*head, *rest], len(head), max_tokens), max_model_len=context)
    text = "".join(map(chr, prompt.token_ids))
    kept = expected(head, rest, context, max_tokens)
    assert text == rendered(kept)
    assert kept[: len(head)] == head
    assert kept[-1] is rest[-1]  # the last message always stays
    dropped = len(rest) + len(head) > len(kept)
    if dropped and len(kept) > len(head) + 1:
        assert kept[len(head)].role != "tool"  # no result whose call was dropped leads


def test_a_conversation_that_fits_is_rendered_once() -> None:
    calls: list[str] = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return encode(text)

    prompts = ChatPrompts(ChatTemplate(TEMPLATE), None, counting)
    messages = [message("user", "a" * 10)]
    prompts.prompt(request(messages, 0, None), max_model_len=100)
    assert len(calls) == 1


def test_tool_results_go_with_their_call() -> None:
    messages = [
        message("system", "S"),
        message("user", "u" * 40),
        message("assistant", "call"),
        message("tool", "r" * 10),
        message("tool", "r" * 10),
        message("user", "v" * 10),
    ]
    # without the first user turn it is 72 characters, still over 60; without the call too,
    # its results would lead: they go with it
    prompt = PROMPTS.prompt(request(messages, 1, None), max_model_len=60)
    assert "".join(map(chr, prompt.token_ids)) == "<system>S<user>" + "v" * 10
