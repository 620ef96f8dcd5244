"""The llama engine's statistics: :class:`LlamaStatistics`, read from the scheduler.

Apart from the engine only to keep it short: one snapshot type and the function filling it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ._scheduler import Scheduler

__all__ = ("LlamaStatistics", "statistics")


class LlamaStatistics(NamedTuple):
    """Counters and gauges of a :class:`LlamaEngine` (counters since it was created)."""

    #: requests that reached the scheduler (rejected ones are not counted)
    requests: int
    #: prompt tokens of those requests (once per request, also for n > 1)
    prompt_tokens: int
    #: tokens generated, over all choices
    generated_tokens: int
    #: draft tokens proposed by speculation and verified
    speculative_proposed: int
    #: draft tokens that matched the model's choice
    speculative_accepted: int
    #: sequences (choices) in a slot now
    running_sequences: int = 0
    #: sequences waiting for a slot now
    waiting_sequences: int = 0
    #: steps run (llama_decode calls)
    steps: int = 0
    #: prompt tokens evaluated (those not found in the cache)
    prefill_tokens: int = 0
    #: prompt tokens found in the cache (a slot's own, copied from another, or a sibling's)
    cached_prompt_tokens: int = 0
    #: tokens fed for decoding: one per sequence and step, plus speculative drafts
    decode_tokens: int = 0
    #: steps by batch size: ``batch_sizes[k]`` steps held k sequences
    batch_sizes: tuple[int, ...] = ()
    #: KV blocks restored from each tier (``{"host": 12}``), and the tokens they held
    kv_tier_hits: dict[str, int] = {}  # noqa: RUF012 - a NamedTuple default, never mutated
    kv_restored_tokens: dict[str, int] = {}  # noqa: RUF012
    #: KV blocks saved to the first tier before their slot was overwritten
    kv_saved_blocks: dict[str, int] = {}  # noqa: RUF012
    #: prompt tokens (cells) pulled from prefill workers, and their bytes
    transferred_tokens: int = 0
    transferred_bytes: int = 0
    #: transfer handles whose cells could not be pulled (the prompt was prefilled here)
    transfer_recomputed: int = 0
    #: seconds spent pulling cells from prefill workers
    transfer_seconds: float = 0.0
    #: running sequences moved down into a free slot (one batch serves them all again)
    compactions: int = 0


def statistics(scheduler: Scheduler, waiting: int, pull_seconds: float) -> LlamaStatistics:
    """``scheduler``'s counters and load; ``waiting``: slots asked for by requests still
    queued for admission; ``pull_seconds``: time spent pulling KV."""
    counters = scheduler.counters
    return LlamaStatistics(
        requests=counters.requests,
        prompt_tokens=counters.prompt,
        generated_tokens=counters.generated,
        speculative_proposed=counters.proposed,
        speculative_accepted=counters.accepted,
        running_sequences=scheduler.running,
        waiting_sequences=waiting + scheduler.queued,
        steps=counters.steps,
        prefill_tokens=counters.prefill,
        cached_prompt_tokens=counters.cached,
        decode_tokens=counters.decode,
        batch_sizes=tuple(counters.batch_sizes),
        kv_tier_hits=dict(counters.tier_hits),
        kv_restored_tokens=dict(counters.restored),
        kv_saved_blocks=dict(counters.saved),
        transferred_tokens=counters.transferred_tokens,
        transferred_bytes=counters.transferred_bytes,
        transfer_recomputed=counters.recomputed,
        transfer_seconds=pull_seconds,
        compactions=counters.compactions,
    )
