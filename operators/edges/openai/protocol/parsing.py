"""The boundary: a chat or completions body becomes its request model, or :class:`InvalidRequest`.

Both go through :func:`operators.edges.http.schema.parse_body`, as every edge's bodies do
(``param`` names the offending field: ``"messages.0.content"``); the fields of OpenAI's that
the server cannot honour are refused first (:mod:`operators.edges.openai.unsupported`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from operators.edges.http.schema import parse_body
from operators.edges.openai.unsupported import CHAT_UNSUPPORTED, COMPLETIONS_UNSUPPORTED

from .requests import ChatCompletionRequest, CompletionRequest

__all__ = ("parse_chat_request", "parse_completion_request")


def parse_chat_request(body: bytes | str | Mapping[str, Any]) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    return parse_body(ChatCompletionRequest, body, unsupported=CHAT_UNSUPPORTED)


def parse_completion_request(body: bytes | str | Mapping[str, Any]) -> CompletionRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    return parse_body(CompletionRequest, body, unsupported=COMPLETIONS_UNSUPPORTED)
