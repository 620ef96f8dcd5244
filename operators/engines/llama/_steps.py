"""What the scheduler records: one :class:`LlamaStep` per step, and running counters.

Why records of steps: what a user of the engine feels (a long prompt pausing the others,
a batch that never fills) is a property of steps, not of wall-clock time; tests assert on
these records, and the counters feed ``statistics()`` and the Prometheus series.
"""

from __future__ import annotations

from typing import NamedTuple, final

__all__ = ("Counters", "LlamaStep")


class LlamaStep(NamedTuple):
    """What one step of the llama engine did (:meth:`LlamaEngine.recent_steps`)."""

    #: slots that decoded: their pending token, plus drafts when speculating
    decoded: tuple[int, ...]
    #: those of them whose drafts were verified in this step
    drafted: tuple[int, ...]
    #: tokens fed for them (one per slot, plus the drafts)
    decode_tokens: int
    #: slots that got a chunk of their prompt
    prefilled: tuple[int, ...]
    #: prompt tokens evaluated
    prefill_tokens: int
    #: how long llama_decode took, in seconds
    seconds: float
    #: the adapter (LoRA) every sequence of the step ran with (None: the base model)
    adapter: str | None = None

    @property
    def batch_size(self) -> int:
        """Sequences in the step."""
        return len(self.decoded) + len(self.prefilled)


@final
class Counters:
    """The scheduler's counters: written by its thread only, read from anywhere."""

    __slots__ = (
        "accepted",
        "batch_sizes",
        "cached",
        "compactions",
        "decode",
        "generated",
        "prefill",
        "prompt",
        "proposed",
        "recomputed",
        "requests",
        "restored",
        "saved",
        "steps",
        "tier_hits",
        "transferred_bytes",
        "transferred_tokens",
    )

    def __init__(self, parallel: int) -> None:
        self.requests = 0
        self.prompt = 0
        self.generated = 0
        self.proposed = 0
        self.accepted = 0
        self.steps = 0
        self.prefill = 0
        self.cached = 0
        self.decode = 0
        #: running sequences moved down into a free slot (see ``Scheduler._compact``)
        self.compactions = 0
        #: steps by batch size (index: sequences in the step)
        self.batch_sizes = [0] * (parallel + 1)
        #: KV blocks saved to the top tier, by tier; blocks and tokens restored, by tier
        self.saved: dict[str, int] = {}
        self.tier_hits: dict[str, int] = {}
        self.restored: dict[str, int] = {}
        #: prompt cells pulled from prefill workers, and their bytes
        self.transferred_tokens = 0
        self.transferred_bytes = 0
        #: handles whose cells could not be pulled: their prompts were prefilled here
        self.recomputed = 0
