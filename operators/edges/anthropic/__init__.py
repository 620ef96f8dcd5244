"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) as an edge
on the default graph.

The request becomes a chat request for the graph (:mod:`.conversation`); the graph's
events become content blocks and Anthropic's stream events (:mod:`.render`); failures are
said in Anthropic's shape and status codes (:mod:`.errors`). :class:`AnthropicEdge` has
the routes.
"""

from __future__ import annotations

from .edge import AnthropicEdge as AnthropicEdge
from .errors import ANTHROPIC_ERRORS as ANTHROPIC_ERRORS
from .protocol import MessagesRequest as MessagesRequest
from .protocol import parse_messages_request as parse_messages_request
from .render import MessageRenderer as MessageRenderer

__all__ = (
    "ANTHROPIC_ERRORS",
    "AnthropicEdge",
    "MessageRenderer",
    "MessagesRequest",
    "parse_messages_request",
)
