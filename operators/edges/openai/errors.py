"""What goes wrong, as OpenAI says it: :data:`OPENAI_ERRORS`, the OpenAI edge's error style.

The plumbing decides what went wrong (:class:`~operators.edges.http.failures.ApiError`);
this module says it in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)
and status codes, in one table that can be read, and changed, in one place::

    invalid_request (bad JSON, UTF-8, a field)   400 invalid_request_error, param
    unauthorized (a missing or wrong API key)    401 invalid_request_error, invalid_api_key
    forbidden (another key's usage)              403 invalid_request_error, permission_denied
    not_found (a path, a model, a stored id)     404 invalid_request_error (model_not_found)
    method_not_allowed / too_large               405 / 413 invalid_request_error
    unsupported_media_type / headers_too_large   415 / 431 invalid_request_error
    rate_limited (a key's limit, Retry-After)    429 requests or tokens, rate_limit_exceeded
    overloaded (max_inflight, with Retry-After)  503 service_unavailable_error
    unavailable (no worker, shutting down)       503 service_unavailable_error
    timeout (past the request's deadline)        504 timeout_error, request_timeout
    internal (EngineError, anything else)        500 server_error

A key's limits travel in OpenAI's headers (:meth:`OpenAIErrors.rate_headers`), on a 429
and on every answer to a limited key: ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests`` (a duration: ``6m0s``,
``1.5s``, ``12ms``: until the bucket is full again) and the same three for ``-tokens``.

An error after a stream has started is sent as one ``data: {"error": {...}}`` event, and
the stream then closes *without* ``data: [DONE]`` (as OpenAI does), so a client can tell a
failed stream from a finished one. The Responses edge speaks OpenAI's errors too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final, final

import orjson

from operators.edges.http.failures import (
    INTERNAL_MESSAGE,
    ApiError,
    ErrorKind,
    Rendered,
    at_capacity,
    body_too_large,
    describe_failure,
    draining,
    error_headers,
    method_not_allowed,
    shut_down,
    timed_out,
    unauthorized,
    unknown_model,
    unknown_path,
)
from operators.edges.http.limits import Standing, duration
from pipeline import InvalidRequest

if TYPE_CHECKING:
    from operators.edges.http.limits import Rates

__all__ = (
    "INTERNAL_MESSAGE",
    "OPENAI_ERRORS",
    "OpenAIErrors",
    "at_capacity_body",
    "body_too_large_body",
    "describe_failure",
    "draining_body",
    "error_body",
    "invalid_request_body",
    "method_not_allowed_body",
    "shut_down_body",
    "timeout_error_body",
    "unauthorized_body",
    "unknown_model_body",
    "unknown_path_body",
)

#: kind -> (status, OpenAI's error type)
_STATUS: Final[Mapping[ErrorKind, tuple[int, str]]] = {
    "invalid_request": (400, "invalid_request_error"),
    "unauthorized": (401, "invalid_request_error"),
    "forbidden": (403, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "too_large": (413, "invalid_request_error"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "headers_too_large": (431, "invalid_request_error"),
    "rate_limited": (429, "requests"),
    "overloaded": (503, "service_unavailable_error"),
    "unavailable": (503, "service_unavailable_error"),
    "timeout": (504, "timeout_error"),
    "internal": (500, "server_error"),
}


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    """An OpenAI-shaped error body."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


@final
class OpenAIErrors:
    """The :class:`~operators.edges.http.failures.ErrorStyle` of OpenAI's APIs."""

    __slots__ = ()

    def status(self, error: ApiError) -> int:
        """The HTTP status OpenAI gives ``error``."""
        return _STATUS[error.kind][0]

    def body(self, error: ApiError) -> bytes:
        """``{"error": {...}}`` for ``error``."""
        return error_body(error.message, _type(error), param=error.param, code=error.code)

    def render(self, error: ApiError, request_id: str | None = None) -> Rendered:
        """``error`` as a whole response (a 401 also says ``WWW-Authenticate: Bearer``; a
        429 the key's limits)."""
        status = _STATUS[error.kind][0]
        headers = error_headers(error)
        if error.kind == "unauthorized":
            headers += ((b"www-authenticate", b"Bearer"),)
        if error.rates is not None:
            headers += self.rate_headers(error.rates)
        return Rendered(
            status,
            error_body(error.message, _type(error), param=error.param, code=error.code),
            headers,
        )

    def rate_headers(self, rates: Rates) -> tuple[tuple[bytes, bytes], ...]:
        """A key's limits as OpenAI tells them: ``x-ratelimit-{limit,remaining,reset}-
        {requests,tokens}``."""
        return _rate_headers("requests", rates.requests) + _rate_headers("tokens", rates.tokens)


def _type(error: ApiError) -> str:
    """OpenAI's error ``type``: a 429's names the limit (``requests`` or ``tokens``)."""
    if error.kind == "rate_limited" and error.rates is not None:
        return "tokens" if error.rates.refused_by == "tokens" else "requests"
    return _STATUS[error.kind][1]


def _rate_headers(kind: str, standing: Standing | None) -> tuple[tuple[bytes, bytes], ...]:
    if standing is None:
        return ()
    name = kind.encode()
    return (
        (b"x-ratelimit-limit-" + name, b"%d" % standing.limit),
        (b"x-ratelimit-remaining-" + name, b"%d" % standing.remaining),
        (b"x-ratelimit-reset-" + name, duration(standing.reset).encode()),
    )


#: the one instance (the style has no state)
OPENAI_ERRORS: Final = OpenAIErrors()


# Bodies by name, as the server's earlier modules offered them.


def invalid_request_body(exc: InvalidRequest) -> bytes:
    """400: the request is malformed; ``param`` names the field to blame, if any."""
    return error_body(exc.message, "invalid_request_error", param=exc.param)


def body_too_large_body(limit: int) -> bytes:
    """413: the request body is over ``limit`` bytes."""
    return OPENAI_ERRORS.body(body_too_large(limit))


def method_not_allowed_body(path: str, allowed: str) -> bytes:
    """405: ``path`` answers only ``allowed``."""
    return OPENAI_ERRORS.body(method_not_allowed(path, allowed))


def unknown_path_body(path: str) -> bytes:
    """404: nothing is served at ``path``."""
    return OPENAI_ERRORS.body(unknown_path(path))


def unknown_model_body(name: str, served: str) -> bytes:
    """404: the request names a model other than the one served."""
    return OPENAI_ERRORS.body(unknown_model(name, served))


def draining_body() -> bytes:
    """503: the server is shutting down and takes no new request."""
    return OPENAI_ERRORS.body(draining())


def at_capacity_body(limit: int) -> bytes:
    """503 (with ``Retry-After``): ``limit`` requests are in flight already."""
    return OPENAI_ERRORS.body(at_capacity(limit))


def shut_down_body() -> bytes:
    """503: the server ended the request while shutting down."""
    return OPENAI_ERRORS.body(shut_down())


def unauthorized_body(presented: bool) -> bytes:
    """401: OpenAI's shape (``code: invalid_api_key``)."""
    return OPENAI_ERRORS.body(unauthorized(presented))


def timeout_error_body(seconds: float) -> bytes:
    """504: the request ran past its deadline (or the stream's last event)."""
    return OPENAI_ERRORS.body(timed_out(seconds))
