"""One way from a request body to a typed request, for every edge: :func:`parse_body`.

Every API edge (chat, completions, Responses, Messages, count_tokens, embeddings,
tokenize, the LoRA routes, a user's own) parses its bodies here, the same way::

    bytes --orjson--> a JSON object              400: not JSON, not UTF-8, not an object
          --> fields asked for and not honoured  400 naming the field (Unsupported)
          --> null top-level fields dropped      (null means "the default")
          --> the edge's pydantic model          400 naming the field as the client sent it

so a wrong type anywhere is a 400 naming its field on every edge, never a 500, and the
rules below hold for every API alike:

- **Field names come from the error's location**, not from lists kept by hand. Union
  members are tagged by :func:`kind` (``~string``, ``~text``...): :func:`invalid_request`
  drops those tags and keeps the fields and indexes (``messages.0.content``).
- **Discriminators are two**: :func:`by_shape` (a string, an array of strings, an array of
  arrays, another array, an object) and :func:`by_type` (an object's ``type``). Each gives
  its union one clear message instead of one error per member.
- **Free-form JSON is bounded**: :data:`JsonObject` (tool parameters, schemas, a tool
  call's input...) nests at most :data:`MAX_DEPTH` levels, far below what the serializers
  take (orjson and pydantic stop at 255), so a deep object is a 400 naming its field, not
  a 500 when the request is dumped, rendered or stored.
- **An unsupported field** (:class:`Unsupported`) is refused unless its value is one of
  those that ask for nothing; the values are compared with ``==``, never iterated, so a
  value of any type is safe to check before validation.
- **Stop strings** are one type (:data:`Stop`, :data:`StopList`), bounded in number;
  OpenAI's ``metadata`` is one type (:data:`Metadata`), bounded as OpenAI bounds it.
- **A nested field the server cannot honour** is refused the same way, by the field's own
  annotation (:func:`refused`), so every field an API's SDK can send is either modelled or
  refused by name (``tests/operators/edges/test_edge_fields.py`` checks it against the
  official SDKs' request types).
- **Large bodies are parsed off the event loop** (:data:`OFF_LOOP_BYTES`, the host's
  ``offload``): parsing is linear, but 250k items still take a second of one core.

Integers and booleans are strict (JSON ``true`` is not a count) and bounded by
:data:`MAX_INT`: engines hold counts and ids in 32-bit integers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, TypeVar

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
)
from pydantic import ValidationError as _ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from pipeline import InvalidRequest

__all__ = (
    "ARRAY",
    "ARRAYS",
    "MAX_CONVERSATION_KEY",
    "MAX_DEPTH",
    "MAX_INT",
    "MAX_STOP_STRINGS",
    "NOTHING",
    "OBJECT",
    "OFF_LOOP_BYTES",
    "STRING",
    "STRINGS",
    "Bool",
    "ConversationKey",
    "Count",
    "Float",
    "JsonObject",
    "Metadata",
    "Model",
    "Priority",
    "Stop",
    "StopList",
    "TokenId",
    "Unsupported",
    "by_shape",
    "by_type",
    "invalid",
    "invalid_request",
    "kind",
    "parse_body",
    "refused",
    "unique_names",
)

#: the largest count or token id a request may give: engines hold them in 32-bit integers
#: (llama.cpp's ``llama_token`` and ``n_predict``), and a bound at the edge keeps a value
#: no engine can hold (``max_tokens: 2**63``) a 400 naming its field instead of a 500 deep
#: inside one
MAX_INT: Final = 2**31 - 1
#: how deep free-form JSON (:data:`JsonObject`) may nest: far below the 255 levels where
#: orjson and pydantic stop serializing, with room for the response around it
MAX_DEPTH: Final = 64
#: most stop strings one request may give
MAX_STOP_STRINGS: Final = 64
#: bodies larger than this are parsed (and turned into the graph's request) in a worker
#: thread, one at a time, so that they never stall the other requests
OFF_LOOP_BYTES: Final = 64 * 1024

# Integers and booleans are strict: JSON ``true`` is not a count, ``"yes"`` not a boolean.
Count = Annotated[int, Field(strict=True, ge=1, le=MAX_INT)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_INT)]
Float = Annotated[float, Field(allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]
#: a request's scheduling priority (vLLM's ``priority``): lower runs earlier, 0 by default
#: (or the API key's); bounded both ways like every integer (:mod:`pipeline.priority`)
Priority = Annotated[int, Field(strict=True, ge=-MAX_INT, le=MAX_INT)]
#: the longest conversation key (``prompt_cache_key``, the ``x-session-affinity`` header)
MAX_CONVERSATION_KEY: Final = 1024
#: a conversation's name (OpenAI's ``prompt_cache_key``): requests sharing it are kept on
#: one worker while its load allows (``PreprocessedRequest.affinity``)
ConversationKey = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_CONVERSATION_KEY)]


class Model(BaseModel):
    """Unknown fields are ignored (other servers' ``extra_body`` extensions), not refused."""

    model_config = ConfigDict(extra="ignore", frozen=False, validate_assignment=False)


def invalid(param: str, message: str) -> PydanticCustomError:
    """An error for a rule across fields, carrying the field to blame."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})


# ------------------------------------------------------------------------ free-form JSON


def _bounded(value: dict[str, Any]) -> dict[str, Any]:
    """``value``, unless it nests deeper than :data:`MAX_DEPTH` (checked in one pass)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > MAX_DEPTH:
            raise PydanticCustomError(
                "too_deep", "nested deeper than {limit} levels", {"limit": MAX_DEPTH}
            )
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                push((child, depth + 1))
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded)]
"""A JSON object the server keeps as it came (a schema, a tool call's input), at most
:data:`MAX_DEPTH` levels deep."""


# ------------------------------------------------------------------------ discriminators

#: the tags :func:`by_shape` gives: a string, an array whose first item is a string, an
#: array whose first item is an array, any other array (empty too), an object
STRING: Final = "~string"
STRINGS: Final = "~strings"
ARRAYS: Final = "~arrays"
ARRAY: Final = "~array"
OBJECT: Final = "~object"
_TAG_MARK: Final = "~"


def kind(name: str) -> Tag:
    """The tag of a union member that :func:`by_type` picks when ``type`` is ``name``
    (a by_shape tag, ``STRING``..., is used as it is)."""
    return Tag(name if name.startswith(_TAG_MARK) else _TAG_MARK + name)


def _shapes(value: Any) -> tuple[str, ...]:
    """The shapes ``value`` has, the most specific first."""
    if isinstance(value, str):
        return (STRING,)
    if isinstance(value, list):
        first = value[0] if value else None
        if isinstance(first, str):
            return (STRINGS, ARRAY)
        if isinstance(first, list):
            return (ARRAYS, ARRAY)
        return (ARRAY,)
    if isinstance(value, dict):
        return (OBJECT,)
    return ()


def by_shape(message: str, *shapes: str, error: str = "invalid_type") -> Discriminator:
    """A union told apart by its value's JSON shape; its members are tagged with
    ``shapes`` (:data:`STRING`, :data:`STRINGS`, :data:`ARRAYS`, :data:`ARRAY`,
    :data:`OBJECT`), and a value of no such shape is a 400 saying ``message``.

    An array whose first item is a string goes to the :data:`STRINGS` member if there is
    one, else to the :data:`ARRAY` member (whose own errors then name the bad item).
    """
    offered = frozenset(shapes)

    def pick(value: Any) -> str | None:
        return next((shape for shape in _shapes(value) if shape in offered), None)

    return Discriminator(pick, custom_error_type=error, custom_error_message=message)


def by_type(
    message: str,
    types: Collection[str] | Mapping[str, str],
    *,
    untyped: str | None = None,
    error: str = "invalid_type",
) -> Discriminator:
    """A union of objects told apart by their ``type`` field: each type in ``types`` picks
    the member tagged ``kind(type)`` (a mapping names the member of each type); an object
    without ``type`` picks ``kind(untyped)`` (None: refused); anything else is a 400
    saying ``message``."""
    tags = {name: kind(member).tag for name, member in _members(types).items()}
    default = None if untyped is None else kind(untyped).tag

    def pick(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        found = value.get("type")
        if found is None:
            return default
        return tags.get(found) if isinstance(found, str) else None

    return Discriminator(pick, custom_error_type=error, custom_error_message=message)


def _members(types: Collection[str] | Mapping[str, str]) -> Mapping[str, str]:
    return types if isinstance(types, Mapping) else {name: name for name in types}


# ------------------------------------------------------------------------- stop strings


def _stop_strings(stop: str | list[str]) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise PydanticCustomError(
            "too_long", "at most {limit} stop strings are allowed", {"limit": MAX_STOP_STRINGS}
        )
    if "" in stops:
        raise PydanticCustomError("empty_stop", "stop strings must not be empty")
    return stops


StopList = Annotated[list[str], AfterValidator(_stop_strings)]
"""Stop strings as an array: at most :data:`MAX_STOP_STRINGS`, none empty."""

Stop = Annotated[
    Annotated[str, kind(STRING)] | Annotated[list[str], kind(ARRAY)],
    by_shape("stop must be a string or an array of strings", STRING, ARRAY, error="invalid_stop"),
    AfterValidator(_stop_strings),
]
"""Stop strings as OpenAI takes them: one string or an array (always a list once
validated)."""


#: OpenAI's limits on ``metadata``
_METADATA_KEYS: Final = 16
_METADATA_KEY_CHARS: Final = 64
_METADATA_VALUE_CHARS: Final = 512


def _metadata_fits(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > _METADATA_KEYS:
        raise PydanticCustomError(
            "too_long", "at most {limit} metadata keys are allowed", {"limit": _METADATA_KEYS}
        )
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
            raise PydanticCustomError(
                "too_long",
                "metadata keys hold at most {keys} characters and values at most {values}",
                {"keys": _METADATA_KEY_CHARS, "values": _METADATA_VALUE_CHARS},
            )
    return metadata


Metadata = Annotated[dict[str, str], AfterValidator(_metadata_fits)]
"""OpenAI's ``metadata`` (chat, Responses): string values, at most 16 keys of 64 characters
and values of 512. Kept with a stored response; changes nothing about the answer."""


def unique_names(names: list[str], param: str) -> None:
    """Refuse two equal names (``param.N`` blames the second); linear in their number.

    Raises:
        PydanticCustomError: the first repeated name (for a model validator).
    """
    seen: set[str] = set()
    for position, name in enumerate(names):
        if name in seen:
            raise invalid(f"{param}.{position}", f"two {param} are named '{name}'")
        seen.add(name)


# --------------------------------------------------------------------------- the boundary


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A field of an API that the server cannot honour: refused with ``message`` unless
    its value is one of ``harmless`` (those that ask for nothing beyond a plain request:
    ``tool_choice: "none"``, an empty list). Values are compared with ``==`` only, so any
    JSON value is safe to check."""

    message: str
    harmless: tuple[Any, ...] = (None,)

    def asks(self, value: Any) -> bool:
        """Whether ``value`` asks for what the server cannot do."""
        return not any(value == ok and type(value) is type(ok) for ok in self.harmless)


#: values that ask for nothing: absent, false or empty
NOTHING: Final[tuple[Any, ...]] = (None, False, "", (), [], {})


def refused(rule: Unsupported) -> BeforeValidator:
    """The annotation of a nested field the server cannot honour: a value ``rule`` does
    not find harmless is a 400 naming the field's path (``text.verbosity``), checked
    before the field's own type (any JSON value is safe to compare)."""

    def check(value: Any) -> Any:
        if rule.asks(value):
            raise PydanticCustomError("unsupported", "{message}", {"message": rule.message})
        return value

    return BeforeValidator(check)


M = TypeVar("M", bound=BaseModel)


def parse_body(
    model: type[M],
    body: bytes | str | Mapping[str, Any],
    *,
    unsupported: Mapping[str, Unsupported] | None = None,
) -> M:
    """``body`` (JSON, or an already decoded object) as a ``model``.

    Fields in ``unsupported`` are refused first unless harmless; top-level nulls mean the
    default; unknown fields are ignored.

    Raises:
        InvalidRequest: not JSON, not UTF-8, not an object, an unsupported or invalid field
            (``param`` names it as the client sent it: ``messages.0.content``).
    """
    data: Any = body
    if not isinstance(body, Mapping):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if isinstance(body, bytes) and not _is_utf8(body):
                raise InvalidRequest("the request body is not valid UTF-8") from exc
            raise InvalidRequest(f"could not parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        if isinstance(data, Mapping):
            data = dict(data)
        else:
            raise InvalidRequest(
                f"the request body must be a JSON object, not {type(data).__name__}"
            )
    for name, rule in (unsupported or {}).items():
        if name in data and rule.asks(data[name]):
            raise InvalidRequest(rule.message, param=name)
    if None in data.values():
        data = {key: value for key, value in data.items() if value is not None}
    try:
        return model.model_validate(data)
    except _ValidationError as exc:
        raise invalid_request(exc) from exc


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _param(error: ErrorDetails) -> str | None:
    ctx = error.get("ctx") or {}
    if "param" in ctx:
        return str(ctx["param"])
    parts = [
        str(segment)
        for segment in error["loc"]
        if isinstance(segment, int)
        or not (segment.startswith(_TAG_MARK) or segment.startswith("["))
    ]
    return ".".join(parts) or None


def invalid_request(exc: _ValidationError) -> InvalidRequest:
    """A pydantic error as the 400 a client reads: the first error's field as ``param`` (its
    location without the union tags: ``messages.0.content``), the message naming it."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    param = _param(first)
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
