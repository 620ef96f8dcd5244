"""What a client sees of a chat response, as a value tests can compare.

Streamed and non-streamed responses reduce to the same fields (text, finish reasons, usage,
logprob entries with their alternatives), so two servers, or the two response modes, can be
asserted equal with ``==``.
"""

from __future__ import annotations

from typing import Any

import anyio
import openai

__all__ = ("chat_once", "chat_stream")


def _entries(content: Any) -> list[Any]:
    return [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content or []
    ]


async def chat_stream(
    api: openai.AsyncOpenAI,
    *,
    started: anyio.Event | None = None,
    model: str = "echo",
    **request: Any,
) -> dict[str, Any]:
    """A streamed chat (with usage) as the client sees it; ``started`` is set at its first
    chunk."""
    stream = await api.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **request
    )
    text, finishes, tokens, usage = "", [], [], None
    async for chunk in stream:
        if started is not None:
            started.set()
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            if choice.logprobs:
                tokens += _entries(choice.logprobs.content)
    return {"text": text, "finishes": finishes, "usage": usage, "logprobs": tokens}


async def chat_once(
    api: openai.AsyncOpenAI, *, model: str = "echo", **request: Any
) -> dict[str, Any]:
    """A non-streamed chat as the client sees it (the same fields as :func:`chat_stream`)."""
    response = await api.chat.completions.create(model=model, **request)
    choice = response.choices[0]
    return {
        "text": choice.message.content,
        "finishes": [choice.finish_reason],
        "usage": response.usage.model_dump() if response.usage else None,
        "logprobs": _entries(choice.logprobs.content if choice.logprobs else None),
    }
