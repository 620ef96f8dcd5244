"""The KV router over LLM workers: :func:`llm_kv_router`, a :class:`pipeline.KvRouter` that
reads what it weighs from a :class:`~operators.contracts.llm.PreprocessedRequest`.

The router in ``pipeline`` knows no requests: it is given how to read a request's block ids,
its prompt length and its conversation. Every KV router over LLM workers reads them alike
(in-process workers, NATS workers, upstream servers, the prefill router), so this is the
one place that says how:

- block ids: :func:`~.kv_blocks.request_block_ids` (the request's ``token_ids``, replayed
  output included, salted by its adapter);
- prompt tokens: ``len(token_ids)`` (what a worker that holds nothing prefills);
- conversation: ``affinity`` (``prompt_cache_key``, ``x-session-affinity``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline import KvRouter

from .kv_blocks import request_block_ids

if TYPE_CHECKING:
    from operators.contracts.llm import PreprocessedRequest
    from pipeline import Context, PrefixIndex

__all__ = ("llm_kv_router", "request_affinity", "request_tokens")


def request_tokens(ctx: Context[PreprocessedRequest]) -> int:
    """The request's prompt length in tokens, replayed output included."""
    return len(ctx.data.token_ids)


def request_affinity(ctx: Context[PreprocessedRequest]) -> str | None:
    """The conversation the request belongs to (None: none named)."""
    return ctx.data.affinity


def llm_kv_router(index: PrefixIndex, *, block_size: int, **options: Any) -> KvRouter:
    """A :class:`~pipeline.KvRouter` over LLM workers whose KV blocks hold ``block_size``
    tokens; ``options`` are the KvRouter's own (weights, ``report``, ``affinity_ttl``...).

    Raises:
        ValueError: an option out of range (the KvRouter's message).
    """
    return KvRouter(
        index,
        request_block_ids(block_size),
        block_size=block_size,
        prompt_tokens=request_tokens,
        session=request_affinity,
        **options,
    )
