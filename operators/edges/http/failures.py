"""What went wrong, before any API says it: :class:`ApiError`, and the styles that say it.

Every edge refuses and fails for the same reasons (a malformed body, a wrong key, a model
it does not serve, the server at its limit or shutting down, a deadline, an engine that
failed); only the words differ. So the plumbing decides *what* went wrong, as an
:class:`ApiError` of one :data:`ErrorKind`, and each edge's :class:`ErrorStyle` decides how
its API says it: the status code, the body's shape, the headers. OpenAI answers a full
server with ``503 service_unavailable_error``, Anthropic with ``529 overloaded_error``,
from the same ``ApiError("overloaded", ...)``.

:func:`describe_failure` is the one mapping from the exceptions a request can raise to an
``ApiError``::

    Refusal                           its ApiError
    InvalidRequest                    invalid_request (param)
    EngineUnavailable, EngineStalled,
    EngineDead                        unavailable, code engine_unavailable, Retry-After
    CapacityExhausted, WorkerLost     unavailable
    EngineError, RequestError         internal, the error's message
    anything else                     internal, a generic message (logged with its traceback)

A handler refuses a request by raising :class:`Refusal` (an ``ApiError`` as an exception).
The graph blames chat's field names; an edge of another API says them its own way, in the
``param`` and in the message (:class:`Rewording`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, Protocol, final

from pipeline import (
    CapacityExhausted,
    EngineDead,
    EngineError,
    EngineStalled,
    EngineUnavailable,
    InvalidRequest,
    RequestError,
    WorkerLost,
)
from pipeline.health import RETRY_AFTER

if TYPE_CHECKING:
    from .limits import Limit, Rates

__all__ = (
    "INTERNAL_MESSAGE",
    "ApiError",
    "ClientGone",
    "ErrorKind",
    "ErrorStyle",
    "Refusal",
    "Rendered",
    "Rewording",
    "at_capacity",
    "body_too_large",
    "describe_failure",
    "draining",
    "error_headers",
    "method_not_allowed",
    "rate_headers",
    "rate_limited",
    "shut_down",
    "timed_out",
    "headers_too_large",
    "not_json",
    "unauthorized",
    "unknown_model",
    "unknown_path",
)

logger = logging.getLogger("operators.edges.http")

INTERNAL_MESSAGE: Final = "The server had an error while processing your request."

ErrorKind = Literal[
    "invalid_request",  # the request is malformed (400)
    "unauthorized",  # a missing or wrong API key (401)
    "forbidden",  # the key may not do this (403)
    "not_found",  # an unknown path, model or stored object (404)
    "method_not_allowed",  # the path answers other methods (405)
    "too_large",  # the body is over the limit (413)
    "unsupported_media_type",  # a body that is not of the content type the route takes (415)
    "headers_too_large",  # the request's headers are over the limit (431)
    "rate_limited",  # the key is over one of its limits (429)
    "overloaded",  # admission control: too many requests in flight
    "unavailable",  # no worker now, a worker lost, the server shutting down
    "timeout",  # the request ran past its deadline
    "internal",  # the engine or the server failed
]
"""Why a request was refused or failed; each edge's :class:`ErrorStyle` gives its status."""


@dataclass(frozen=True, slots=True)
class ApiError:
    """One refusal or failure, in no API's words yet."""

    kind: ErrorKind
    message: str
    #: the request field to blame (a dotted path), or a header
    param: str | None = None
    #: a machine-readable code (OpenAI's ``code``: ``invalid_api_key``, ``model_not_found``)
    code: str | None = None
    #: seconds a client should wait before retrying (the ``Retry-After`` header)
    retry_after: int | None = None
    #: what the response must allow (a 405's ``Allow`` header)
    allow: str | None = None
    #: the key's limits, for the headers each API tells them in (a 429's, exactly)
    rates: Rates | None = None


@final
class Refusal(Exception):
    """A handler's refusal of a request: its :class:`ApiError`, said in the edge's style."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


@final
class ClientGone(Exception):
    """The client left before its request was read (nothing is answered: a 499)."""


@dataclass(frozen=True, slots=True)
class Rendered:
    """An error as one API says it: status, JSON body, extra headers."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


class ErrorStyle(Protocol):
    """How an API says what went wrong (:mod:`operators.edges.openai.errors`,
    :mod:`operators.edges.anthropic.errors`)."""

    def render(self, error: ApiError, request_id: str | None = None) -> Rendered:
        """``error`` as a whole response; ``request_id`` for a body that names it."""
        ...


@final
class Rewording:
    """An error message with chat's field names said as another API says them.

    ``fields``: chat's name -> the API's, replaced wherever a message names it: a name
    with an underscore (``max_tokens``, ``response_format``) wherever it stands as a word,
    quoted or not; a plain word (``messages``, ``stop``) only where it is quoted, since it
    is also English. ``phrases``: other words, replaced where they stand whole (``the
    messages`` -> ``the input``). One pass of one expression.
    """

    __slots__ = ("_pattern", "_words")

    def __init__(self, fields: Mapping[str, str], phrases: Mapping[str, str] | None = None):
        words = {
            (name if "_" in name else f"'{name}'"): (named if "_" in name else f"'{named}'")
            for name, named in fields.items()
        }
        words.update(phrases or {})
        self._words = words
        alternatives = "|".join(re.escape(word) for word in sorted(words, key=len, reverse=True))
        self._pattern = re.compile(rf"(?<![\w.])(?:{alternatives})(?![\w])")

    def __call__(self, message: str) -> str:
        """``message`` in the API's words."""
        return self._pattern.sub(lambda found: self._words[found.group()], message)


def error_headers(error: ApiError) -> tuple[tuple[bytes, bytes], ...]:
    """The headers every style sends with ``error``: ``Retry-After`` (and the SDKs'
    ``retry-after-ms``, exact), ``x-should-retry: false`` for a request no wait will let
    through, ``Allow``."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    if error.retry_after is not None:
        headers += ((b"retry-after", str(error.retry_after).encode()),)
    rates = error.rates
    if rates is not None and rates.retry_after is None:
        headers += ((b"x-should-retry", b"false"),)
    elif rates is not None and rates.retry_after:
        headers += ((b"retry-after-ms", b"%d" % math.ceil(rates.retry_after * 1000)),)
    if error.allow is not None:
        headers += ((b"allow", error.allow.encode()),)
    return headers


def rate_headers(style: ErrorStyle, rates: Rates | None) -> tuple[tuple[bytes, bytes], ...]:
    """A key's limits in the headers of ``style``'s API (its ``rate_headers(rates)``, when
    it has one: OpenAI's ``x-ratelimit-*``, Anthropic's ``anthropic-ratelimit-*``)."""
    if rates is None or not rates.any:
        return ()
    tell = getattr(style, "rate_headers", None)
    return () if tell is None else tuple(tell(rates))


def describe_failure(exc: Exception, request_id: str) -> ApiError:
    """What an exception a request raised means to its client (logged as fits)."""
    if isinstance(exc, Refusal):
        return exc.error
    if isinstance(exc, InvalidRequest):
        return ApiError("invalid_request", exc.message, param=exc.param)
    if isinstance(exc, EngineUnavailable | EngineStalled | EngineDead):
        logger.info("request %s: %s: %s", request_id, type(exc).__name__, exc)
        wait = exc.retry_after if isinstance(exc, EngineUnavailable) else RETRY_AFTER
        return ApiError("unavailable", exc.message, code="engine_unavailable", retry_after=wait)
    if isinstance(exc, CapacityExhausted | WorkerLost):
        logger.info("request %s: %s: %s", request_id, type(exc).__name__, exc)
        return ApiError("unavailable", exc.message)
    if isinstance(exc, EngineError | RequestError):
        logger.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        return ApiError("internal", exc.message)
    logger.error("request %s failed unexpectedly", request_id, exc_info=exc)
    return ApiError("internal", f"{INTERNAL_MESSAGE} (request id {request_id})")


# ------------------------------------------------------------- the refusals every edge shares


def unauthorized(presented: bool) -> ApiError:
    """A guarded path called without a valid key (the API key check)."""
    message = (
        "Incorrect API key provided."
        if presented
        else "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' "
        "(or 'x-api-key: YOUR_KEY')."
    )
    return ApiError("unauthorized", message, code="invalid_api_key")


def body_too_large(limit: int) -> ApiError:
    """The request body is over ``limit`` bytes."""
    return ApiError("too_large", f"The request body exceeds {limit} bytes.")


def not_json(content_type: str | None) -> ApiError:
    """A JSON route sent a body of another content type (or of none): what a web page can
    make a browser send to any server without a CORS preflight, so it is never acted on."""
    sent = "no content-type" if content_type is None else f"content-type {content_type!r}"
    return ApiError(
        "unsupported_media_type",
        f"The request body must be JSON, sent with content-type 'application/json' ({sent} "
        "was sent).",
        param="content-type",
    )


def headers_too_large(limit: int) -> ApiError:
    """The request's line and headers are over ``limit`` bytes."""
    return ApiError(
        "headers_too_large", f"The request's headers exceed {limit} bytes.", param="headers"
    )


def method_not_allowed(path: str, allowed: str) -> ApiError:
    """``path`` answers only ``allowed`` (a comma-separated list of methods)."""
    return ApiError("method_not_allowed", f"{path} only accepts {allowed}.", allow=allowed)


def unknown_path(path: str) -> ApiError:
    """Nothing is served at ``path``."""
    return ApiError("not_found", f"Unknown path {path!r}.")


def unknown_model(name: str, served: str | Iterable[str]) -> ApiError:
    """The request names a model the server does not serve (``served``: the names it does)."""
    names = [served] if isinstance(served, str) else list(served)
    serves = ", ".join(repr(n) for n in names) if names else "no model now"
    return ApiError(
        "not_found",
        f"The model {name!r} does not exist; this server serves {serves}.",
        param="model",
        code="model_not_found",
    )


def draining() -> ApiError:
    """The server is shutting down and takes no new request."""
    return ApiError("unavailable", "The server is shutting down.")


def at_capacity(limit: int) -> ApiError:
    """``limit`` generation requests are in flight already (admission control)."""
    return ApiError(
        "overloaded",
        f"The server is at its limit of {limit} requests in flight; retry shortly.",
        retry_after=1,
    )


_PER_MINUTE: Final = {
    "requests": "requests per min (RPM)",
    "tokens": "tokens per min (TPM)",
}


def rate_limited(key: str, refused_by: Limit, asked: int, rates: Rates) -> ApiError:
    """The key ``key`` is over the limit ``refused_by`` (asking ``asked`` of it), said as
    OpenAI says it (``Rate limit reached for ... Limit, Used, Requested``); a request
    larger than the limit is told no wait will do."""
    if refused_by == "inflight":
        return ApiError(
            "rate_limited",
            f"Too many requests in flight for key {key!r}; retry when one has finished.",
            code="rate_limit_exceeded",
            retry_after=1,
            rates=rates,
        )
    standing = rates.requests if refused_by == "requests" else rates.tokens
    assert standing is not None
    which = _PER_MINUTE[refused_by]
    wait = rates.retry_after
    if wait is None:
        return ApiError(
            "rate_limited",
            f"Request too large for key {key!r} on {which}: Limit {standing.limit}, "
            f"Requested {asked}. Reduce the prompt or the output limit.",
            code="rate_limit_exceeded",
            rates=rates,
        )
    used = standing.limit - standing.remaining
    return ApiError(
        "rate_limited",
        f"Rate limit reached for key {key!r} on {which}: Limit {standing.limit}, Used "
        f"{used}, Requested {asked}. Please try again in {wait:.3g}s.",
        code="rate_limit_exceeded",
        retry_after=max(1, math.ceil(wait)),
        rates=rates,
    )


def shut_down() -> ApiError:
    """The server ended the request while shutting down (the drain's abort)."""
    return ApiError("unavailable", "The server shut down before the request finished.")


def timed_out(seconds: float) -> ApiError:
    """The request ran past its deadline."""
    return ApiError(
        "timeout",
        f"The request did not finish within its timeout of {seconds:g} s.",
        code="request_timeout",
    )
