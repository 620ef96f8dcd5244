"""What goes wrong, as OpenAI says it: exceptions and refusals -> HTTP status and error body.

Kept apart from the ASGI plumbing (:mod:`.asgi`) and the app's dispatch (:mod:`.server`) so
that the whole mapping can be read, and changed, in one place. Every error the server sends
is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``)::

    InvalidRequest (bad JSON, bad UTF-8, bad field)  400 invalid_request_error, param
    a missing or wrong API key (/v1/*, when set)     401 invalid_request_error, invalid_api_key
    a model other than the served one                404 invalid_request_error, model_not_found
    CapacityExhausted, WorkerLost, shutting down,    503 service_unavailable_error
      max_inflight reached (with Retry-After)
    past the request's deadline                      504 timeout_error, request_timeout
    EngineError, RequestError                        500 server_error, the error's message
    anything else                                    500 server_error, a generic message (logged)
    a body over the limit / a wrong method / path    413 / 405 / 404 invalid_request_error

An error after a stream has started is sent as one ``data: {"error": {...}}`` event, and
the stream then closes *without* ``data: [DONE]`` (as OpenAI does), so a client can tell a
failed stream from a finished one.
"""

from __future__ import annotations

import logging
from typing import Final

import orjson

from pipeline import CapacityExhausted, EngineError, InvalidRequest, RequestError, WorkerLost

__all__ = (
    "INTERNAL_MESSAGE",
    "at_capacity_body",
    "body_too_large_body",
    "describe_failure",
    "draining_body",
    "error_body",
    "invalid_request_body",
    "method_not_allowed_body",
    "shut_down_body",
    "unknown_model_body",
    "unknown_path_body",
)

logger = logging.getLogger("operators.edges.openai.server")

INTERNAL_MESSAGE: Final = "The server had an error while processing your request."


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    """An OpenAI-shaped error body."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def describe_failure(exc: Exception, request_id: str) -> tuple[int, bytes]:
    """The HTTP status and OpenAI error body for an exception a request raised."""
    if isinstance(exc, InvalidRequest):
        return 400, invalid_request_body(exc)
    if isinstance(exc, CapacityExhausted | WorkerLost):
        logger.info("request %s: %s: %s", request_id, type(exc).__name__, exc)
        return 503, error_body(exc.message, "service_unavailable_error")
    if isinstance(exc, EngineError | RequestError):
        logger.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        return 500, error_body(exc.message, "server_error")
    logger.error("request %s failed unexpectedly", request_id, exc_info=exc)
    return 500, error_body(f"{INTERNAL_MESSAGE} (request id {request_id})", "server_error")


def invalid_request_body(exc: InvalidRequest) -> bytes:
    """400: the request is malformed; ``param`` names the field to blame, if any."""
    return error_body(exc.message, "invalid_request_error", param=exc.param)


def body_too_large_body(limit: int) -> bytes:
    """413: the request body is over ``limit`` bytes."""
    return error_body(f"The request body exceeds {limit} bytes.", "invalid_request_error")


def method_not_allowed_body(path: str, allowed: str) -> bytes:
    """405: ``path`` answers only ``allowed``."""
    return error_body(f"{path} only accepts {allowed}.", "invalid_request_error")


def unknown_path_body(path: str) -> bytes:
    """404: nothing is served at ``path``."""
    return error_body(f"Unknown path {path!r}.", "invalid_request_error")


def unknown_model_body(name: str, served: str) -> bytes:
    """404: the request names a model other than the one served."""
    return error_body(
        f"The model {name!r} does not exist; this server serves {served!r}.",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


def draining_body() -> bytes:
    """503: the server is shutting down and takes no new request."""
    return error_body("The server is shutting down.", "service_unavailable_error")


def at_capacity_body(limit: int) -> bytes:
    """503 (with ``Retry-After``): ``limit`` requests are in flight already."""
    return error_body(
        f"The server is at its limit of {limit} requests in flight; retry shortly.",
        "service_unavailable_error",
    )


def shut_down_body() -> bytes:
    """503: the server ended the request while shutting down (:meth:`OpenAIApp.abort`)."""
    message = "The server shut down before the request finished."
    return error_body(message, "service_unavailable_error")
