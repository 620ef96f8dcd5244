"""Server-sent events as JSON objects, and an upstream's HTTP failures as our errors.

Both upstream kinds stream ``data: {json}`` lines (vLLM ends with ``data: [DONE]``,
llama-server with a chunk whose ``stop`` is true). Whatever breaks the stream on the way is
turned here into the error Migration understands: a reset, an end of stream before the
finish, a line that is not JSON, a server error, are the upstream lost (``WorkerLost``:
another upstream continues the request), while a refusal of the request itself (a 4xx) is
the request's (``InvalidRequest``, naming the field when the upstream says which).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncGenerator
from typing import Any, Final

import anyio
import httpx
import orjson

from pipeline import (
    CapacityExhausted,
    ConnectFailed,
    EngineError,
    InvalidRequest,
    RequestError,
    ResponseTimeout,
    StreamDisconnected,
)

__all__ = ("DONE", "error_of", "events", "mid_stream", "refusal", "transport_error")

#: what :func:`events` yields for vLLM's ``data: [DONE]``
DONE: Final[dict[str, Any]] = {}

#: request fields an upstream's refusal may name, as our ``param`` (most specific first)
_FIELDS: Final = (
    "max_tokens", "min_tokens", "logprobs", "top_logprobs", "temperature", "top_p", "top_k",
    "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
    "priority", "stop_token_ids", "structured_outputs", "grammar", "json_schema", "n",
)  # fmt: skip
_WORDS: Final = {field: re.compile(rf"\b{re.escape(field)}\b") for field in _FIELDS}
_PARAMS: Final = {"grammar": "response_format", "json_schema": "response_format",
                  "structured_outputs": "response_format", "top_logprobs": "logprobs"}  # fmt: skip


async def events(response: httpx.Response, request_id: str) -> AsyncGenerator[dict[str, Any], None]:
    """The JSON objects of ``response``'s ``data:`` lines (:data:`DONE` for ``[DONE]``).

    Closed before the end (a stop, a kill, an error), it closes the response, whose
    connection then closes (the server aborts the request), and lets httpx's own readers
    fail on it: left suspended, each of them would be finalized later by a task of the
    event loop, behind the request's back.

    Raises:
        StreamDisconnected: a line is not a JSON object.
    """
    lines = response.aiter_lines()
    try:
        async for line in lines:
            if not line.startswith("data:"):
                continue  # blank separators, comments (pings), event names
            data = line[5:].strip()
            if data == "[DONE]":
                yield DONE
                continue
            try:
                event = orjson.loads(data)
            except orjson.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                raise StreamDisconnected(
                    f"the upstream sent a line that is not a JSON object: {data[:80]!r}",
                    request_id=request_id,
                )
            yield event
    finally:
        with anyio.CancelScope(shield=True):
            await response.aclose()
            with contextlib.suppress(Exception):  # reading a closed connection fails at once
                async for _ in lines:
                    pass


def error_of(body: Any) -> tuple[str, str | None, int | None]:
    """(message, param, code) of an OpenAI-shaped error body (vLLM's and llama-server's)."""
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        message = str(error.get("message") or error.get("detail") or error)
        param = error.get("param")
        code = error.get("code")
        return (
            message,
            param if isinstance(param, str) else None,
            (code if isinstance(code, int) else None),
        )
    return str(error), None, None


def refusal(status: int, body: bytes, request_id: str) -> RequestError:
    """Our error for an upstream's answer ``status`` (not 2xx) with ``body``.

    4xx: the request's fault (``InvalidRequest``; 429: ``CapacityExhausted``); 5xx: the
    upstream failed it, and another may not (``ConnectFailed``: Migration retries).
    """
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = body.decode(errors="replace")[:200]
    message, param, _ = error_of(parsed)
    text = f"the upstream answered {status}: {message}"
    if status == 429:
        return CapacityExhausted(text, request_id=request_id)
    if status >= 500:
        return ConnectFailed(text, request_id=request_id)
    if status in (401, 403, 404):  # our configuration, not the client's request
        return EngineError(text, request_id=request_id)
    return InvalidRequest(text, param=_param(param, message), request_id=request_id)


def mid_stream(event: dict[str, Any], request_id: str) -> RequestError:
    """Our error for an ``{"error": ...}`` event in the middle of a stream."""
    message, param, code = error_of(event)
    text = f"the upstream failed the request: {message}"
    if code is not None and 400 <= code < 500:
        return InvalidRequest(text, param=_param(param, message), request_id=request_id)
    return StreamDisconnected(text, request_id=request_id)


def _param(param: str | None, message: str) -> str | None:
    """The request field a refusal names: the upstream's ``param``, else the first of ours
    its message mentions."""
    if param is None:
        param = next((field for field, word in _WORDS.items() if word.search(message)), None)
    return None if param is None else _PARAMS.get(param, param)


def transport_error(exc: httpx.HTTPError, *, started: bool, request_id: str) -> RequestError:
    """Our error for an httpx failure: the upstream lost (before any output: ``ConnectFailed``;
    after: ``StreamDisconnected``), or silent too long (``ResponseTimeout``)."""
    text = f"the upstream {'broke off the stream' if started else 'could not be reached'}: "
    text += f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.ReadTimeout):
        return ResponseTimeout(text, request_id=request_id)
    if started:
        return StreamDisconnected(text, request_id=request_id)
    return ConnectFailed(text, request_id=request_id)
