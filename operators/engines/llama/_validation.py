"""Request validation: what a request may ask of the llama engine, checked before it queues.

Why a module of its own: every refusal is an :class:`~pipeline.InvalidRequest` raised in the
request's task, before it waits for a slot, so a malformed request never costs a slot or a
place in the queue, and the messages (which name the likely mistake) live in one place.
"""

from __future__ import annotations

from operators.contracts.llm import PreprocessedRequest
from operators.engines._reasoning_budget import check_budget
from pipeline import InvalidRequest

__all__ = ("token_budget",)


def token_budget(request: PreprocessedRequest, request_id: str, *, n_ctx: int, n_vocab: int) -> int:
    """How many tokens each choice of ``request`` may generate.

    ``n_ctx`` is one sequence's context window: prompt and output must fit in it.

    Raises:
        InvalidRequest: the request cannot run on this model (the message says why).
    """
    prompt = request.token_ids
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt", request_id=request_id)
    if min(prompt) < 0 or max(prompt) >= n_vocab:
        bad = next(t for t in prompt if not 0 <= t < n_vocab)
        raise InvalidRequest(
            f"token id {bad} is not in this model's vocabulary (0..{n_vocab - 1}); "
            "was the prompt encoded with another model's tokenizer?",
            param="prompt",
            request_id=request_id,
        )
    if request.multimodal:
        raise InvalidRequest(
            "the llama engine takes text only", param="messages", request_id=request_id
        )
    room = n_ctx - len(prompt)
    if room <= 0:
        raise InvalidRequest(
            f"the prompt has {len(prompt)} tokens; the model's context window holds "
            f"{n_ctx}, prompt and output together",
            param="prompt",
            request_id=request_id,
        )
    sampling = request.sampling
    if sampling.temperature is not None and sampling.temperature < 0:
        raise InvalidRequest(
            f"temperature must be >= 0, got {sampling.temperature}",
            param="temperature",
            request_id=request_id,
        )
    if sampling.top_p is not None and not 0 <= sampling.top_p <= 1:
        raise InvalidRequest(
            f"top_p must be between 0 and 1, got {sampling.top_p}",
            param="top_p",
            request_id=request_id,
        )
    check_budget(request, request_id)
    unsupported = _unsupported_sampling(request)
    if unsupported is not None:
        raise InvalidRequest(
            f"the llama engine does not support {unsupported}",
            param=unsupported,
            request_id=request_id,
        )
    max_tokens = request.stop.max_tokens
    if max_tokens is None:
        return room
    if max_tokens < 0:
        raise InvalidRequest(
            f"max_tokens must be >= 0, got {max_tokens}",
            param="max_tokens",
            request_id=request_id,
        )
    if max_tokens > room:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
            f"{len(prompt) + max_tokens} exceeds the context window of {n_ctx} tokens: "
            "lower max_tokens or shorten the prompt",
            param="max_tokens",
            request_id=request_id,
        )
    return max_tokens


def _unsupported_sampling(request: PreprocessedRequest) -> str | None:
    """The first sampling option set to something the llama engine's sampler does not do."""
    sampling = request.sampling
    if sampling.min_p not in (None, 0.0):
        return "min_p"
    if sampling.repetition_penalty not in (None, 1.0):
        return "repetition_penalty"
    return None
