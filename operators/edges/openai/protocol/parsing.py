"""The boundary: a request body (JSON) becomes a request model, or :class:`InvalidRequest`.

The one place where JSON and pydantic errors become :class:`pipeline.InvalidRequest`, with
``param`` naming the offending field as a dotted path (``"messages.0.content"``); fields the
server cannot honour are refused first (:mod:`operators.edges.openai.unsupported`).
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from operators.edges.openai.unsupported import refuse_unsupported
from pipeline import InvalidRequest

from .messages import ChatMessage, ContentPart, ImageURL
from .requests import ChatCompletionRequest, CompletionRequest, GenerationRequest, StreamOptions
from .tools import (
    FunctionDefinition,
    JsonSchemaFormat,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ToolDefinition,
)

__all__ = ("from_validation_error", "parse_chat_request", "parse_completion_request")

_M = TypeVar("_M", bound=GenerationRequest)


def parse_chat_request(body: bytes | str | dict[str, Any]) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    return _parse(ChatCompletionRequest, body, supported=_CHAT_ONLY)


def parse_completion_request(body: bytes | str | dict[str, Any]) -> CompletionRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    return _parse(CompletionRequest, body)


#: fields of OpenAI's that the chat endpoint honours and the completions endpoint does not
_CHAT_ONLY: Final = frozenset({"tools", "tool_choice", "response_format"})


def _parse(
    model: type[_M], body: bytes | str | dict[str, Any], *, supported: frozenset[str] = frozenset()
) -> _M:
    data: Any = body
    if not isinstance(body, dict):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if isinstance(body, bytes) and not _is_utf8(body):
                raise InvalidRequest("the request body is not valid UTF-8") from exc
            raise InvalidRequest(f"could not parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {type(data).__name__}")
    refuse_unsupported(data, supported=supported)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for model in models:
        names.update(model.model_fields)
    return frozenset(names)


# Path segments that are field names (or list indexes) stay in ``param``; the others are
# union tags pydantic puts into ``loc`` ("text", "parts", "ids", ...) and are dropped. No tag
# is also a field name of a model it appears under.
_FIELDS: Final = _field_names(
    ChatCompletionRequest,
    CompletionRequest,
    ChatMessage,
    ContentPart,
    ImageURL,
    StreamOptions,
    ToolDefinition,
    FunctionDefinition,
    NamedToolChoice,
    NamedFunction,
    JsonSchemaFormat,
    JsonSchemaSpec,
) | {"schema"}


def _param(error: ErrorDetails, fields: frozenset[str]) -> str | None:
    ctx = error.get("ctx") or {}
    if "param" in ctx:
        return str(ctx["param"])
    parts = [str(seg) for seg in error["loc"] if isinstance(seg, int) or seg in fields]
    return ".".join(parts) or None


def from_validation_error(exc: ValidationError, fields: frozenset[str] = _FIELDS) -> InvalidRequest:
    """A pydantic error as the 400 a client reads: the first error's field as ``param``
    (a dotted path of the segments in ``fields``, the models' field names; the other
    segments are union tags), the message naming it."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    param = _param(first, fields)
    ctx = first.get("ctx") or {}
    if "param" in ctx:  # a rule across fields: its message names the fields itself
        message = str(ctx["message"])
    elif first["type"] == "missing":
        message = f"Missing required parameter: '{param}'"
    elif param is None:
        message = f"Invalid request: {first['msg']}"
    else:
        message = f"Invalid value for '{param}': {first['msg']}"
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return InvalidRequest(message, param=param)
