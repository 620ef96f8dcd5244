"""Request fields the server accepts from OpenAI's API but cannot honour: a 400, never a silent no.

Why: a client that sends ``logit_bias`` or ``audio`` and gets a 200 believes it was
honoured; an answer that ignored the request is worse than an error. (``tools``,
``tool_choice`` and ``response_format`` are honoured by the chat endpoint; the completions
endpoint still refuses them.) Each field here is refused with ``param`` naming it, unless
its value asks for nothing beyond what a plain request does (``tool_choice: "none"``, an
empty ``tools``, ``response_format: {"type": "text"}``, ``modalities: ["text"]``,
``best_of`` equal to 1).

Fields that change nothing about the answer are accepted and ignored: ``user``,
``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls`` (without tools),
``stream_options`` members other than ``include_usage``. Unknown fields (other servers'
extensions) are ignored as before; this table is for OpenAI's own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

from pipeline import InvalidRequest

__all__ = ("UNSUPPORTED_FIELDS", "refuse_unsupported")


def _nonempty(value: Any) -> bool:
    return value not in (None, [], {}, "")


def _response_format(value: Any) -> bool:
    return value is not None and not (isinstance(value, dict) and value.get("type") == "text")


def _choice(value: Any) -> bool:
    return value not in (None, "none", "auto")


def _modalities(value: Any) -> bool:
    return value is not None and value != ["text"]


def _best_of(value: Any) -> bool:
    return value is not None and value != 1


#: field -> (does this value ask for something we do not do?, what to tell the client)
UNSUPPORTED_FIELDS: Final[Mapping[str, tuple[Callable[[Any], bool], str]]] = {
    "response_format": (_response_format, "structured output (response_format) is not supported"),
    "tools": (_nonempty, "tool calling (tools) is not supported"),
    "tool_choice": (_choice, "tool calling (tool_choice) is not supported"),
    "functions": (_nonempty, "function calling (functions) is not supported"),
    "function_call": (_choice, "function calling (function_call) is not supported"),
    "logit_bias": (_nonempty, "'logit_bias' is not supported"),
    "audio": (_nonempty, "audio output is not supported"),
    "modalities": (_modalities, "only the 'text' modality is supported"),
    "prediction": (_nonempty, "predicted outputs ('prediction') are not supported"),
    "web_search_options": (_nonempty, "web search is not supported"),
    "best_of": (_best_of, "'best_of' is not supported"),
    "reasoning_effort": (_nonempty, "'reasoning_effort' is not supported by this model"),
}


def refuse_unsupported(data: Mapping[str, Any], *, supported: Collection[str] = ()) -> None:
    """Raise for the first field of a request body (a JSON object) that asks for a feature
    the server does not implement; ``supported`` names the fields of the table that this
    endpoint does honour (the chat endpoint: tools and ``response_format``).

    Raises:
        InvalidRequest: ``param`` names the field.
    """
    for name, (asks, message) in UNSUPPORTED_FIELDS.items():
        if name in data and name not in supported and asks(data[name]):
            raise InvalidRequest(message, param=name)
