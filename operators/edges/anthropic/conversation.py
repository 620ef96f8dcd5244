"""A Messages request as what the graph takes: turns and blocks -> a chat request.

The forward half of the Anthropic edge::

    system (string or text blocks)     -> a system message first
    user turn: text, image blocks      -> a user message (images as image parts)
               tool_result blocks      -> tool messages answering their tool_use_id, first
    assistant turn: text blocks        -> the assistant's content
                    tool_use blocks    -> its tool_calls (input as JSON arguments)
                    thinking blocks    -> not shown to the model again
    stop_sequences -> stop; tools -> function tools; tool_choice auto/any/tool/none ->
    auto/required/named/none (disable_parallel_tool_use: parallel_tool_calls false);
    metadata.user_id -> user
    thinking enabled, budget_tokens N -> thinking_token_budget N (the engine ends the
                                         reasoning past N tokens)
    thinking disabled                 -> reasoning_effort "none" (the template's
                                         enable_thinking false)
    thinking adaptive                 -> nothing (the model reasons as it does)

so the chat template, the tool-call parser, the stop jail and migration work as for chat.
"""

from __future__ import annotations

from typing import Any

import orjson

from operators.edges.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    ImageURL,
    NamedFunction,
    NamedToolChoice,
    ToolChoice,
    ToolDefinition,
)

from .protocol import (
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)

__all__ = ("chat_messages", "chat_request")


def _message(role: str, **fields: Any) -> ChatMessage:
    values: dict[str, Any] = {"content": None, "name": None, "tool_calls": None}
    values["tool_call_id"] = None
    values.update(fields)
    return ChatMessage.model_construct(role=role, **values)


def _user_content(blocks: list[Any]) -> str | list[ContentPart]:
    """Text and image blocks as a message's content: a string unless there are images."""
    if not any(isinstance(block, ImageBlock) for block in blocks):
        return "\n".join(block.text for block in blocks)
    return [
        ContentPart.model_construct(
            type="image_url", text=None, image_url=ImageURL.model_construct(url=block.url)
        )
        if isinstance(block, ImageBlock)
        else ContentPart.model_construct(type="text", text=block.text, image_url=None)
        for block in blocks
    ]


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "\n".join(part.text for part in content if isinstance(part, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _turn(turn: MessageParam) -> list[ChatMessage]:
    content = turn.content
    if isinstance(content, str):
        return [_message(turn.role, content=content)]
    if turn.role == "user":
        messages = [
            _message("tool", content=_result_text(block), tool_call_id=block.tool_use_id)
            for block in content
            if isinstance(block, ToolResultBlock)
        ]
        rest = [block for block in content if isinstance(block, TextBlock | ImageBlock)]
        if rest or not messages:
            messages.append(_message("user", content=_user_content(rest)))
        return messages
    text = "\n".join(block.text for block in content if isinstance(block, TextBlock))
    calls = [
        {
            "id": block.id,
            "type": "function",
            "function": {"name": block.name, "arguments": orjson.dumps(block.input).decode()},
        }
        for block in content
        if isinstance(block, ToolUseBlock)
    ]
    return [
        _message("assistant", content=text or (None if calls else ""), tool_calls=calls or None)
    ]


def chat_messages(request: CountTokensRequest) -> list[ChatMessage]:
    """The request's system prompt and turns as chat messages, in order."""
    messages: list[ChatMessage] = []
    system = request.system_text
    if system:
        messages.append(_message("system", content=system))
    for turn in request.messages:
        messages.extend(_turn(turn))
    return messages


def _tool_choice(request: CountTokensRequest) -> ToolChoice | None:
    choice = request.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        assert choice.name is not None  # (validated)
        return NamedToolChoice.model_construct(
            type="function", function=NamedFunction.model_construct(name=choice.name)
        )
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]  # type: ignore[return-value]


def chat_request(request: CountTokensRequest, *, stream: bool = False) -> ChatCompletionRequest:
    """The chat request for ``request`` (a whole Messages request, or a count_tokens one:
    then only what decides the prompt)."""
    tools = [
        ToolDefinition.model_construct(
            type="function",
            function=FunctionDefinition.model_construct(
                name=tool.name,
                description=tool.description,
                parameters=tool.input_schema,
                strict=None,
            ),
        )
        for tool in request.tools or ()
    ]
    choice = request.tool_choice
    parallel = None
    if choice is not None and choice.disable_parallel_tool_use:
        parallel = False
    fields: dict[str, Any] = {}
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled":
        fields["thinking_token_budget"] = thinking.budget_tokens
    elif thinking is not None and thinking.type == "disabled":
        fields["reasoning_effort"] = "none"
    if isinstance(request, MessagesRequest):
        fields |= {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "user": request.user,
            "stream": stream,
            "priority": request.priority,
        }
    return ChatCompletionRequest.model_construct(
        model=request.model,
        messages=chat_messages(request),
        tools=tools or None,
        tool_choice=_tool_choice(request),
        parallel_tool_calls=parallel,
        **fields,
    )
