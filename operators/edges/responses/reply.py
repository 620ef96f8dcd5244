"""One Responses API answer, streamed or whole, and its record in the store:
:class:`ResponsesReply` (the edge's :class:`~operators.edges.http.generation.Reply`).

A finished response is stored (unless ``store: false``) *before* its last event is
written: a client that reads ``response.completed`` and at once continues the
conversation, on this frontend or another, finds it. A store that fails makes the response
fail (an error event, or a 500), never a silent "stored"; a record too large for the
store is the client's to fix (a 400 naming ``store``: the edge refuses what it can tell
before generating, this is the answer that came out larger than the room left).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

import orjson

from operators.edges.openai.events import OpenAIEvent, ResponseHead, Usage
from operators.edges.openai.sse import is_visible
from pipeline import InvalidRequest, RequestError

from .store import StoredResponse, StoreFull

if TYPE_CHECKING:
    from operators.edges.http.failures import ApiError

    from .render import ResponseRenderer
    from .store import ResponseStore

__all__ = ("ResponsesReply",)


@final
class ResponsesReply:
    """Renders the graph's events with ``renderer``; stores the finished response in
    ``store`` as ``owner``'s, with ``input_items`` (None: ``store: false``, kept nowhere).
    ``translate`` puts the edge's field names into an error."""

    __slots__ = ("_input_items", "_owner", "_renderer", "_store", "_translate")

    def __init__(
        self,
        renderer: ResponseRenderer,
        *,
        store: ResponseStore,
        owner: str,
        input_items: list[dict[str, Any]] | None,
        translate: Callable[[ApiError], ApiError],
    ) -> None:
        self._renderer = renderer
        self._store = store
        self._owner = owner
        self._input_items = input_items
        self._translate = translate

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
        """Text, reasoning or a call piece."""
        return is_visible(event)

    async def end(self) -> bytes:
        """Store the finished response; ``response.completed`` (or ``.incomplete``)."""
        response = self._renderer.finished()
        await self._save(response)
        return self._renderer.terminal(response)

    def failure(self, error: ApiError) -> bytes:
        """``response.failed``, with what went wrong."""
        return self._renderer.failure(self._translate(error))

    async def body(self, events: list[Any]) -> bytes:
        """The response object, stored first."""
        render = self._renderer.render
        for event in events:
            render(event)
        response = self._renderer.finished()
        await self._save(response)
        return orjson.dumps(response)

    @property
    def usage(self) -> Usage | None:
        """The graph's token counts, once they went by."""
        return self._renderer.usage

    @property
    def output_tokens(self) -> int:
        """The response's output tokens, once its usage went by."""
        usage = self._renderer.usage
        return 0 if usage is None else usage.completion_tokens

    async def _save(self, response: dict[str, Any]) -> None:
        if self._input_items is None:
            return
        record = StoredResponse(response, self._input_items, self._owner)
        try:
            store: Any = self._store
            if getattr(store, "by_owner", False):  # (it shares its room fairly by owner)
                await store.put(response["id"], record.encode(), owner=self._owner)
            else:
                await store.put(response["id"], record.encode())
        except StoreFull as exc:
            raise InvalidRequest(
                f"the response could not be stored: {exc}; send 'store': false",
                param="store",
            ) from exc
        except Exception as exc:  # a store of the user's, NATS gone, a record too large
            raise RequestError(f"the response could not be stored: {exc}") from exc
