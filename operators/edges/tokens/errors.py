"""How the tokens-in/tokens-out edge says what went wrong: vLLM's ``ErrorResponse``.

OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with vLLM's ``code``:
the HTTP status as a number. A client of vLLM's endpoint (a router, our remote engine)
tells a refusal (4xx: the request's fault, not retried) from a failure (5xx: another
server may not fail) by it, in a whole response and in a stream's error event alike.
"""

from __future__ import annotations

from typing import final

import orjson

from operators.edges.http.failures import ApiError, Rendered
from operators.edges.openai.errors import OPENAI_ERRORS

__all__ = ("VLLM_ERRORS", "VllmErrors")


@final
class VllmErrors:
    """The :class:`~operators.edges.http.failures.ErrorStyle` of vLLM's own endpoints."""

    __slots__ = ()

    def body(self, error: ApiError) -> bytes:
        """``{"error": {...}}`` for ``error``, ``code`` its status."""
        rendered = OPENAI_ERRORS.render(error)
        body = orjson.loads(rendered.body)
        body["error"]["code"] = rendered.status
        return orjson.dumps(body)

    def render(self, error: ApiError, request_id: str | None = None) -> Rendered:
        """``error`` as a whole response (OpenAI's status and headers)."""
        rendered = OPENAI_ERRORS.render(error, request_id)
        return Rendered(rendered.status, self.body(error), rendered.headers)


#: the one instance (the style has no state)
VLLM_ERRORS = VllmErrors()
