"""Request fields the server accepts from OpenAI's API but cannot honour: a 400, never a silent no.

Why: a client that sends ``logit_bias`` or ``audio`` and gets a 200 believes it was
honoured; an answer that ignored the request is worse than an error. (``tools``,
``tool_choice`` and ``response_format`` are honoured by the chat endpoint; the completions
endpoint still refuses them.) Each field here is refused with ``param`` naming it, unless
its value asks for nothing beyond what a plain request does (``tool_choice: "none"``, an
empty ``tools``, ``response_format: {"type": "text"}``, ``modalities: ["text"]``,
``best_of`` equal to 1): :class:`~operators.edges.http.schema.Unsupported`.

Fields that change nothing about the answer are accepted and ignored: ``user``,
``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls`` (without tools),
``stream_options`` members other than ``include_usage``. Unknown fields (other servers'
extensions) are ignored as before; these tables are for OpenAI's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from operators.edges.http.schema import NOTHING, Unsupported

__all__ = ("CHAT_UNSUPPORTED", "COMPLETIONS_UNSUPPORTED")

_CHOICE: Final = (None, "none", "auto")

#: the fields neither endpoint honours (field -> the rule)
_NEITHER: Final[Mapping[str, Unsupported]] = {
    "functions": Unsupported("function calling (functions) is not supported", NOTHING),
    "function_call": Unsupported("function calling (function_call) is not supported", _CHOICE),
    "logit_bias": Unsupported("'logit_bias' is not supported", NOTHING),
    "audio": Unsupported("audio output is not supported", NOTHING),
    "modalities": Unsupported("only the 'text' modality is supported", (None, ["text"])),
    "prediction": Unsupported("predicted outputs ('prediction') are not supported", NOTHING),
    "web_search_options": Unsupported("web search is not supported", NOTHING),
    "best_of": Unsupported("'best_of' is not supported", (None, 1)),
    "reasoning_effort": Unsupported("'reasoning_effort' is not supported by this model", NOTHING),
}

#: ``/v1/chat/completions``: tools and ``response_format`` are honoured there
CHAT_UNSUPPORTED: Final[Mapping[str, Unsupported]] = _NEITHER

#: ``/v1/completions``: no tools, no structured output
COMPLETIONS_UNSUPPORTED: Final[Mapping[str, Unsupported]] = {
    "response_format": Unsupported(
        "structured output (response_format) is not supported", (None, {"type": "text"})
    ),
    "tools": Unsupported("tool calling (tools) is not supported", NOTHING),
    "tool_choice": Unsupported("tool calling (tool_choice) is not supported", _CHOICE),
    **_NEITHER,
}
