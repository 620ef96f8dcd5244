"""What goes wrong, as Anthropic says it: :data:`ANTHROPIC_ERRORS`.

Anthropic's shape is ``{"type": "error", "error": {"type": ..., "message": ...},
"request_id": ...}``; a field to blame is named in the message (prefixed, ``stop_sequences:
...``, when the message does not name it), as Anthropic's own messages do. The statuses are
Anthropic's (its SDK maps each to its error class: ``BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ``RateLimitError``, ``OverloadedError``...)::

    invalid_request      400 invalid_request_error
    unauthorized         401 authentication_error
    forbidden            403 permission_error
    not_found            404 not_found_error
    method_not_allowed   405 invalid_request_error
    too_large            413 request_too_large
    unsupported_media_type / headers_too_large   415 / 431 invalid_request_error
    rate_limited         429 rate_limit_error (a key's limit; with retry-after)
    overloaded           529 overloaded_error (max_inflight; with retry-after)
    unavailable          529 overloaded_error (no worker now, shutting down)
    timeout              504 timeout_error
    internal             500 api_error

A key's limits travel in Anthropic's headers (:meth:`AnthropicErrors.rate_headers`), on a
429 and on every answer to a limited key: ``anthropic-ratelimit-requests-limit``,
``-remaining`` and ``-reset`` (an RFC 3339 moment: when the bucket is full again), and the
same three for ``-tokens``.

The graph speaks chat's field names; :func:`translate` gives this API's, in the field
blamed and in the message (``stop`` is ``stop_sequences``, a prompt too long is
``messages``, a reasoning budget ``thinking.budget_tokens``, reasoning turned off
``thinking.type``). A stream that fails after it started ends with ``event: error``
carrying the same object.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final, final

import orjson

from operators.edges.http.failures import ApiError, ErrorKind, Rendered, Rewording, error_headers
from operators.edges.http.limits import Standing, rfc3339

if TYPE_CHECKING:
    from operators.edges.http.limits import Rates

__all__ = ("ANTHROPIC_ERRORS", "AnthropicErrors", "error_event", "translate")

_STATUS: Final[Mapping[ErrorKind, tuple[int, str]]] = {
    "invalid_request": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "not_found": (404, "not_found_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "too_large": (413, "request_too_large"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "headers_too_large": (431, "invalid_request_error"),
    "rate_limited": (429, "rate_limit_error"),
    "overloaded": (529, "overloaded_error"),
    "unavailable": (529, "overloaded_error"),
    "timeout": (504, "timeout_error"),
    "internal": (500, "api_error"),
}
#: the graph's field names -> this API's
_PARAMS: Final[Mapping[str, str]] = {
    "stop": "stop_sequences",
    "prompt": "messages",
    "max_completion_tokens": "max_tokens",
    "reasoning_effort": "thinking.type",  # (only thinking: disabled sets an effort: none)
    "thinking_token_budget": "thinking.budget_tokens",
}
#: ... and in messages
_REWORD: Final = Rewording(
    _PARAMS, {"the prompt": "the messages", "tool_choice 'required'": "tool_choice 'any'"}
)


def translate(error: ApiError) -> ApiError:
    """``error`` with the field it blames named as this API names it, in ``param`` and in
    its message."""
    param = error.param
    named = param
    if param is not None:
        head = param.partition(".")[0]
        if head == "messages":  # the chat messages' numbering is not the turns' (system, tools)
            named = "messages"
        elif head in _PARAMS:
            named = _PARAMS[head]
    message = _REWORD(error.message)
    if named == param and message == error.message:
        return error
    return ApiError(
        error.kind, message, named, error.code, error.retry_after, error.allow, error.rates
    )


def _object(error: ApiError, request_id: str | None) -> dict[str, object]:
    message = error.message
    if error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    body: dict[str, object] = {
        "type": "error",
        "error": {"type": _STATUS[error.kind][1], "message": message},
    }
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_event(error: ApiError, request_id: str | None = None) -> bytes:
    """A failed stream's last event: ``event: error``."""
    data = orjson.dumps(_object(translate(error), request_id))
    return b"event: error\ndata: " + data + b"\n\n"


@final
class AnthropicErrors:
    """The :class:`~operators.edges.http.failures.ErrorStyle` of Anthropic's API."""

    __slots__ = ()

    def render(self, error: ApiError, request_id: str | None = None) -> Rendered:
        """``error`` as a whole response (a 429 with the key's limits)."""
        error = translate(error)
        status = _STATUS[error.kind][0]
        headers = error_headers(error)
        if error.rates is not None:
            headers += self.rate_headers(error.rates)
        return Rendered(status, orjson.dumps(_object(error, request_id)), headers)

    def rate_headers(self, rates: Rates) -> tuple[tuple[bytes, bytes], ...]:
        """A key's limits as Anthropic tells them: ``anthropic-ratelimit-{requests,tokens}-
        {limit,remaining,reset}``."""
        now = time.time()
        return _rate_headers("requests", rates.requests, now) + _rate_headers(
            "tokens", rates.tokens, now
        )


def _rate_headers(
    kind: str, standing: Standing | None, now: float
) -> tuple[tuple[bytes, bytes], ...]:
    if standing is None:
        return ()
    prefix = b"anthropic-ratelimit-" + kind.encode()
    return (
        (prefix + b"-limit", b"%d" % standing.limit),
        (prefix + b"-remaining", b"%d" % standing.remaining),
        (prefix + b"-reset", rfc3339(now + standing.reset).encode()),
    )


#: the one instance (the style has no state)
ANTHROPIC_ERRORS: Final = AnthropicErrors()
