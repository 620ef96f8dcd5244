"""OpenAI's Responses API (``/v1/responses``), stateful, as an edge on the default graph.

The request becomes a chat request for the graph (:mod:`.conversation`: items in, chat
messages out, with the stored conversation of ``previous_response_id`` before them); the
graph's events become output items and the Responses stream's events
(:mod:`.render`); finished responses are kept in a :class:`ResponseStore`
(:mod:`.store`: in memory by default, :mod:`.nats_store` across frontends) for ``GET``,
``DELETE``, ``input_items`` and continuations. :class:`ResponsesEdge` has the routes.
"""

from __future__ import annotations

from .edge import ResponsesEdge as ResponsesEdge
from .protocol import ResponsesRequest as ResponsesRequest
from .protocol import parse_responses_request as parse_responses_request
from .render import ResponseRenderer as ResponseRenderer
from .store import MemoryResponseStore as MemoryResponseStore
from .store import ResponseStore as ResponseStore
from .store import StoredResponse as StoredResponse

__all__ = (
    "MemoryResponseStore",
    "ResponseRenderer",
    "ResponseStore",
    "ResponsesEdge",
    "ResponsesRequest",
    "StoredResponse",
    "parse_responses_request",
)
