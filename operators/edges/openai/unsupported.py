"""Request fields the server accepts from OpenAI's API but cannot honour: a 400, never a silent no.

Why: a client that sends ``logit_bias`` or ``audio`` and gets a 200 believes it was
honoured; an answer that ignored the request is worse than an error. (``tools``,
``tool_choice`` and ``response_format`` are honoured by the chat endpoint; the completions
endpoint still refuses them.) Each field here is refused with ``param`` naming it, unless
its value asks for nothing beyond what a plain request does (``tool_choice: "none"``, an
empty ``tools``, ``response_format: {"type": "text"}``, ``modalities: ["text"]``,
``best_of`` equal to 1, ``verbosity: "medium"``): :class:`~operators.edges.http.schema.Unsupported`.

Every other field OpenAI's SDK can send is modelled (the request models of
:mod:`operators.edges.openai.protocol`); those that change nothing about the answer are
accepted and ignored: ``user``, ``safety_identifier``, ``metadata``, ``store`` (a chat
completion is not kept), the prompt cache's options (the engines cache prefixes by
themselves; ``prompt_cache_key`` names the conversation the router keeps on one worker),
``parallel_tool_calls`` (without tools), ``stream_options``
members other than ``include_usage``. Unknown fields (other servers' extensions) are
ignored as before; these tables are for OpenAI's own. ``tests/operators/edges/
test_edge_fields.py`` checks every field of the SDK's request types is one or the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from operators.edges.http.schema import NOTHING, Unsupported

__all__ = (
    "ALLOWED_CALLERS",
    "CHAT_UNSUPPORTED",
    "COMPLETIONS_UNSUPPORTED",
    "DEFER_LOADING",
    "SERVICE_TIER",
    "VERBOSITY",
)

_CHOICE: Final = (None, "none", "auto")

#: ``verbosity`` (chat) and ``text.verbosity`` (Responses): one rule for both
VERBOSITY: Final = Unsupported(
    "only verbosity 'medium' is supported: nothing makes the model terser or wordier than it is",
    (None, "medium"),
)
#: ``service_tier`` (chat and Responses): one rule for both
SERVICE_TIER: Final = Unsupported(
    "only service_tier 'auto' is supported (every request is served alike)",
    (None, "auto", "default"),
)

#: a tool's ``defer_loading`` (Responses, Messages): tools are always shown to the model
DEFER_LOADING: Final = Unsupported(
    "tool search ('defer_loading') is not supported: every tool is shown to the model", NOTHING
)
#: a tool's ``allowed_callers`` (Responses, Messages): the model calls tools directly only
ALLOWED_CALLERS: Final = Unsupported(
    "only direct tool calls are supported ('allowed_callers': ['direct'])",
    (None, [], ["direct"]),
)

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
    "moderation": Unsupported("moderation is not supported", NOTHING),
    "verbosity": VERBOSITY,
    "service_tier": SERVICE_TIER,
}

#: ``/v1/chat/completions``: tools and ``response_format`` are honoured there
CHAT_UNSUPPORTED: Final[Mapping[str, Unsupported]] = _NEITHER

#: ``/v1/completions``: no tools, no structured output, no reasoning settings
COMPLETIONS_UNSUPPORTED: Final[Mapping[str, Unsupported]] = {
    "response_format": Unsupported(
        "structured output (response_format) is not supported", (None, {"type": "text"})
    ),
    "tools": Unsupported("tool calling (tools) is not supported", NOTHING),
    "tool_choice": Unsupported("tool calling (tool_choice) is not supported", _CHOICE),
    "reasoning_effort": Unsupported(
        "'reasoning_effort' is supported on /v1/chat/completions only", NOTHING
    ),
    "thinking_token_budget": Unsupported(
        "'thinking_token_budget' is supported on /v1/chat/completions only", (None,)
    ),
    **_NEITHER,
}
