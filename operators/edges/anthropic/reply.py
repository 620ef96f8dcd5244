"""One Anthropic message, streamed or whole: :class:`AnthropicReply` (the edge's
:class:`~operators.edges.http.generation.Reply`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

import orjson

from operators.edges.openai.events import OpenAIEvent, ResponseHead, Usage
from operators.edges.openai.sse import is_visible

from .errors import error_event

if TYPE_CHECKING:
    from operators.edges.http.failures import ApiError

    from .render import MessageRenderer

__all__ = ("AnthropicReply",)


@final
class AnthropicReply:
    """Renders the graph's events with ``renderer``."""

    __slots__ = ("_renderer",)

    def __init__(self, renderer: MessageRenderer) -> None:
        self._renderer = renderer

    def start(self, first: OpenAIEvent) -> Callable[[OpenAIEvent], bytes]:
        """The renderer (``first`` must be the graph's head).

        Raises:
            TypeError: the graph's first event is not a ResponseHead.
        """
        if not isinstance(first, ResponseHead):
            raise TypeError(
                f"the graph's first event is {type(first).__name__}, not a ResponseHead"
            )
        return self._renderer.render

    def visible(self, event: OpenAIEvent) -> bool:
        """Text, thinking or a call piece."""
        return is_visible(event)

    async def end(self) -> bytes:
        """``message_delta`` (stop reason, usage) and ``message_stop``."""
        return self._renderer.tail()

    def failure(self, error: ApiError) -> bytes:
        """``event: error``."""
        return error_event(error, self._renderer.message_id)

    async def body(self, events: list[Any]) -> bytes:
        """The message object."""
        render = self._renderer.render
        for event in events:
            render(event)
        return orjson.dumps(self._renderer.finished())

    @property
    def usage(self) -> Usage | None:
        """The graph's token counts, once they went by."""
        return self._renderer.usage

    @property
    def output_tokens(self) -> int:
        """The message's output tokens, once its usage went by."""
        usage = self._renderer.usage
        return 0 if usage is None else usage.completion_tokens
