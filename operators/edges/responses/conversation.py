"""A Responses request as what the graph takes: a conversation of items -> a chat request.

The forward half of the Responses edge. A request's ``input`` (and, with
``previous_response_id``, the stored conversation before it) is a list of *items*; the
graph takes a :class:`~operators.edges.openai.protocol.ChatCompletionRequest`. So:

* :func:`input_items` turns the request's input into items as they are stored and listed
  (``input_items``): ids given, content as parts (``input_text``, ``output_text``,
  ``input_image``), string outputs kept;
* :func:`chat_request` turns a conversation of items into chat messages, in order, and the
  request's settings into the chat request's::

      instructions              -> a system message first (never carried over)
      message                   -> a message of its role (developer: system)
      function_call (+ more)    -> the assistant's tool_calls, with its text before them
      function_call_output      -> a tool message answering its call_id
      reasoning                 -> kept in the record, not shown to the model again

  ``tools`` (the flat shape) become chat tools, ``tool_choice`` its chat form,
  ``text.format`` the ``response_format``, ``max_output_tokens`` the output limit,
  ``reasoning.effort`` the ``reasoning_effort``; the tool-call parser, structured output,
  reasoning, stop strings and migration then work as for chat.

The chat request is a :class:`ResponsesChatRequest`, which names its output limit
``max_output_tokens`` in the preprocessor's errors and, under ``truncation: "auto"``, lets
the preprocessor drop the oldest messages after the instructions until the conversation
fits the context (:mod:`operators.edges.openai.chat_prompt`). The stored conversation
stays whole: the next turn is truncated again, from all of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from operators.edges.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    ImageURL,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolChoice,
    ToolDefinition,
)

from .protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ImagePart,
    MessageItem,
    NamedFunctionChoice,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
    TextPart,
)

__all__ = ("ResponsesChatRequest", "chat_messages", "chat_request", "input_items", "item_text")


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request becomes: its output limit is
    ``max_output_tokens``, so the preprocessor's errors name that field; with ``truncation:
    "auto"``, the messages after the first ``truncate_after`` (the instructions) may be
    dropped, oldest first, to fit the context."""

    #: None: never truncated (``truncation: "disabled"``)
    truncate_after: int | None = None

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_output_tokens"

    @property
    def truncation_keep(self) -> int | None:
        return self.truncate_after


def _parts(content: str | Sequence[Any], text_type: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": text_type, "text": content}]
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, TextPart):
            parts.append({"type": part.type, "text": part.text})
        elif isinstance(part, RefusalPart):
            parts.append({"type": "refusal", "refusal": part.refusal})
        elif isinstance(part, ImagePart):
            parts.append(
                {
                    "type": "input_image",
                    "image_url": part.image_url,
                    "detail": part.detail or "auto",
                }
            )
    return parts


def input_items(request: ResponsesRequest, id_base: str) -> list[dict[str, Any]]:
    """The request's ``input`` as stored items; ids ``<prefix>_<id_base><n>`` for items
    that came without one."""
    given = request.input
    if isinstance(given, str):
        given = [MessageItem(role="user", content=given)]
    items: list[dict[str, Any]] = []
    for position, item in enumerate(given):
        item_id = item.id
        if isinstance(item, MessageItem):
            text_type = "output_text" if item.role == "assistant" else "input_text"
            stored: dict[str, Any] = {
                "id": item_id or f"msg_{id_base}i{position:04x}",
                "type": "message",
                "role": item.role,
                "status": "completed",
                "content": _parts(item.content, text_type),
            }
        elif isinstance(item, FunctionCallItem):
            stored = {
                "id": item_id or f"fc_{id_base}i{position:04x}",
                "type": "function_call",
                "status": "completed",
                "call_id": item.call_id,
                "name": item.name,
                "arguments": item.arguments,
            }
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            stored = {
                "id": item_id or f"fco_{id_base}i{position:04x}",
                "type": "function_call_output",
                "status": "completed",
                "call_id": item.call_id,
                "output": output if isinstance(output, str) else _parts(output, "input_text"),
            }
        else:
            reasoning: ReasoningItem = item
            stored = {
                "id": item_id or f"rs_{id_base}i{position:04x}",
                "type": "reasoning",
                "summary": reasoning.summary,
                "content": reasoning.content or [],
            }
        items.append(stored)
    return items


def item_text(content: str | Iterable[dict[str, Any]]) -> str:
    """The text of an item's content: its text parts (and refusals) joined by newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(
        str(part.get("text", part.get("refusal", "")))
        for part in content
        if part.get("type") != "input_image"
    )


def _message(item: dict[str, Any]) -> ChatMessage:
    role = item["role"]
    content = item["content"]
    if role != "assistant" and any(part.get("type") == "input_image" for part in content):
        parts = [
            ContentPart.model_construct(
                type="image_url",
                text=None,
                image_url=ImageURL.model_construct(url=part["image_url"], detail=None),
            )
            if part.get("type") == "input_image"
            else ContentPart.model_construct(type="text", text=item_text([part]), image_url=None)
            for part in content
        ]
        return ChatMessage.model_construct(
            role=role, content=parts, name=None, tool_calls=None, tool_call_id=None
        )
    return ChatMessage.model_construct(
        role=role, content=item_text(content), name=None, tool_calls=None, tool_call_id=None
    )


def chat_messages(items: Iterable[dict[str, Any]], instructions: str | None) -> list[ChatMessage]:
    """The conversation's items as chat messages, in order (see the module's table)."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(
            ChatMessage.model_construct(
                role="system", content=instructions, name=None, tool_calls=None, tool_call_id=None
            )
        )
    calls_open = False  # the last message is an assistant's that may take more calls
    for item in items:
        kind = item.get("type")
        if kind == "message":
            messages.append(_message(item))
            calls_open = item["role"] == "assistant"
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if calls_open and last is not None:
                if last.tool_calls is None:
                    last.tool_calls = []
                last.tool_calls.append(call)  # (not a copy per call: linear in the calls)
            else:
                messages.append(
                    ChatMessage.model_construct(
                        role="assistant",
                        content=None,
                        name=None,
                        tool_calls=[call],
                        tool_call_id=None,
                    )
                )
                calls_open = True
        elif kind == "function_call_output":
            messages.append(
                ChatMessage.model_construct(
                    role="tool",
                    content=item_text(item["output"]),
                    name=None,
                    tool_calls=None,
                    tool_call_id=item["call_id"],
                )
            )
            calls_open = False
        # reasoning: not shown again (templates drop earlier turns' thinking)
    return messages


def _tool_choice(request: ResponsesRequest) -> ToolChoice | None:
    choice = request.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        return NamedToolChoice.model_construct(
            type="function", function=NamedFunction.model_construct(name=choice.name)
        )
    return choice


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonObjectFormat.model_construct(type="json_object")
    spec = JsonSchemaSpec.model_construct(
        name=fmt.name, description=fmt.description, schema_=fmt.schema_ or {}, strict=fmt.strict
    )
    return JsonSchemaFormat.model_construct(type="json_schema", json_schema=spec)


def chat_request(
    request: ResponsesRequest, conversation: Iterable[dict[str, Any]]
) -> ResponsesChatRequest:
    """The chat request for ``request`` over ``conversation`` (the stored items, then the
    request's own)."""
    tools = [
        ToolDefinition.model_construct(
            type="function",
            function=FunctionDefinition.model_construct(
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            ),
        )
        for tool in request.tools or ()
    ]
    reasoning = request.reasoning
    return ResponsesChatRequest.model_construct(
        model=request.model,
        messages=chat_messages(conversation, request.instructions),
        reasoning_effort=None if reasoning is None else reasoning.effort,
        truncate_after=(1 if request.instructions else 0) if request.truncation == "auto" else None,
        stream=request.stream,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=request.stop,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=request.stop_token_ids,
        user=request.user,
        tools=tools or None,
        tool_choice=_tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs if request.logprobs else None,
        priority=request.priority,
        prompt_cache_key=request.prompt_cache_key,
    )
