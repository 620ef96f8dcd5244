"""How many tokens a generation request may use, read off the graph's request (its output
limit, choices and prompts) so that every edge's request is measured alike without the
plumbing knowing its type: what :mod:`.admission` reserves of a key's tokens per minute,
and what the fair queue weighs a request at.
"""

from __future__ import annotations

import math
from typing import Any, Final

__all__ = ("DEFAULT_COST", "estimate", "needed", "output_limit")

#: what a request that tells nothing of its size is taken to cost in the fair queue
DEFAULT_COST: Final = 256
#: bytes of a request's body per prompt token, standing for its prompt until it is
#: tokenized (OpenAI's own estimate: about 4 for English, and JSON's keys)
_BYTES_PER_TOKEN: Final = 4


def output_limit(request: Any) -> int | None:
    """The output tokens a graph request may generate, in all its choices and prompts, as
    it asked (None: it set no limit). Read off the request's own fields (``max_tokens``,
    ``n``, a completions batch's prompts), so that every edge's request is measured alike
    without the plumbing knowing its type."""
    asked = getattr(request, "requested_max_tokens", None)
    limit = asked[0] if isinstance(asked, tuple) else getattr(request, "max_tokens", None)
    if not isinstance(limit, int):
        return None
    return limit * _choices(request)


def _choices(request: Any) -> int:
    n = getattr(request, "n", 1)
    prompts = getattr(request, "prompts", None)
    legs = len(prompts) if isinstance(prompts, list) and prompts else 1
    return (n if isinstance(n, int) and n > 0 else 1) * legs


def needed(request: Any, prompt: int, context: int | None, tpm: int | None) -> int:
    """The tokens a generation request of ``prompt`` tokens may use on a model of
    ``context`` tokens: its prompt and its output limit (every choice's, every prompt's), or
    without one the context's room, though no more than a minute of ``tpm`` holds (a
    request is not refused for asking no limit; it settles what it used)."""
    asked = output_limit(request)
    if asked is not None:
        return prompt + asked
    if context is None:
        return prompt
    n = getattr(request, "n", 1)
    n = n if isinstance(n, int) and n > 0 else 1
    room = max(0, context * (_choices(request) // n) - prompt) * n
    return prompt + room if tpm is None else min(prompt + room, max(prompt, tpm))


def estimate(
    request: Any, body_bytes: int, context: int | None, tpm: int | None
) -> tuple[int, int]:
    """(the tokens to hold of a key's ``tpm`` when a generation request arrives, what the
    fair queue weighs it at), before its prompt is tokenized: its body's bytes stand for
    its prompt (about 4 a token, as OpenAI estimates; the prompt's tokens replace them
    before the engine runs), so that a refusal's wait covers the whole request. Never more
    than the minute holds, unless its own output limit alone is more (a 429 that no wait
    will lift)."""
    prompt = math.ceil(body_bytes / _BYTES_PER_TOKEN)
    whole = needed(request, prompt, context, tpm)
    cost = (
        whole if output_limit(request) is not None or context is not None else whole + DEFAULT_COST
    )
    if tpm is None:
        return 0, cost
    asked = output_limit(request)
    return (whole if asked is not None and asked > tpm else min(whole, tpm)), cost
