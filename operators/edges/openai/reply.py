"""Chat completions and completions as OpenAI answers them: :class:`OpenAIReply`.

The OpenAI edge's rendering half (:class:`~operators.edges.http.generation.Reply`): a
stream renders each event through :class:`~.sse.SseRenderer` (bytes once per event) and
ends with ``data: [DONE]``; a failed stream ends with one ``data: {"error": ...}`` event
and no ``[DONE]``; a whole response is :func:`~.events.aggregate_chat` /
:func:`~.events.aggregate_completion` of the same events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

import orjson

from .errors import OPENAI_ERRORS
from .events import OpenAIEvent, ResponseHead, Usage, aggregate_chat, aggregate_completion
from .protocol import ChatCompletionRequest
from .sse import DONE, SseRenderer, is_visible

if TYPE_CHECKING:
    from operators.edges.http.failures import ApiError

    from .preprocessor import OpenAIRequest

__all__ = ("OpenAIReply",)


@final
class OpenAIReply:
    """One chat or completions response, streamed or whole."""

    __slots__ = ("_chat", "_include_usage", "_renderer", "_tokens", "_usage")

    def __init__(self, request: OpenAIRequest) -> None:
        self._chat = isinstance(request, ChatCompletionRequest)
        self._include_usage = request.include_usage
        self._renderer: SseRenderer | None = None
        self._tokens = 0
        self._usage: Usage | None = None

    def start(self, first: OpenAIEvent) -> Callable[[OpenAIEvent], bytes]:
        """The renderer of this response's chunks (``first`` must be its head).

        Raises:
            TypeError: the graph's first event is not a :class:`~.events.ResponseHead`.
        """
        if not isinstance(first, ResponseHead):
            raise TypeError(
                f"the graph's first event is {type(first).__name__}, not a ResponseHead"
            )
        self._renderer = SseRenderer(first, include_usage=self._include_usage)
        return self._renderer.render

    def visible(self, event: OpenAIEvent) -> bool:
        """Text, reasoning or a call piece: see :func:`~.sse.is_visible`."""
        return is_visible(event)

    async def end(self) -> bytes:
        """``data: [DONE]``."""
        return DONE

    def failure(self, error: ApiError) -> bytes:
        """``data: {"error": {...}}`` (and no ``[DONE]`` after it)."""
        return b"data: " + OPENAI_ERRORS.body(error) + b"\n\n"

    async def body(self, events: list[Any]) -> bytes:
        """The ``chat.completion`` or ``text_completion`` object."""
        self._usage = next((e for e in reversed(events) if isinstance(e, Usage)), None)
        response = aggregate_chat(events) if self._chat else aggregate_completion(events)
        usage = response["usage"]
        if usage is not None:
            self._tokens = usage["completion_tokens"]
        return orjson.dumps(response)

    @property
    def usage(self) -> Usage | None:
        """The graph's token counts, once they went by (a whole response's: after
        :meth:`body`)."""
        renderer = self._renderer
        return self._usage if renderer is None else renderer.usage

    @property
    def output_tokens(self) -> int:
        """The response's completion tokens, once its usage went by."""
        renderer = self._renderer
        return self._tokens if renderer is None else renderer.output_tokens
