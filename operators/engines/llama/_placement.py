"""Where a new sequence goes: the free slot whose KV cells already hold most of its prompt.

Apart from the scheduler because it is a pure decision over the slots' cached tokens (a
prefix cache without a cache structure: every slot keeps the cells of the sequence that
left it), easy to reason about on its own; the scheduler applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from ._sequence import Sequence as Choice

__all__ = ("choose_slot", "compaction")

#: a cached prefix at least this much longer in an occupied slot is copied, not prefilled
#: (a copy moves the whole KV stream: a few ms, against ~3 ms per prompt token)
_MIN_COPY: Final = 16


def choose_slot(
    cached: Sequence[Sequence[int]],
    slots: Sequence[object | None],
    free: list[int],
    prompt: Sequence[int],
) -> tuple[int, int, int]:
    """``(slot, reused, donor)`` for a sequence with ``prompt``: the free slot caching the
    longest prefix of it (the lowest on a tie: llama.cpp batches consecutive sequence ids
    together) and how many of its tokens it keeps; or, when an occupied slot (``donor``,
    -1 if none) caches a longer prefix by at least ``_MIN_COPY`` tokens, the first free slot,
    to receive a copy of the donor's prefix. ``cached[s]`` is slot ``s``'s tokens,
    ``slots[s]`` its sequence (None when free).
    """
    limit = len(prompt) - 1  # the last prompt token is always evaluated: its logits
    slot, reused = free[0], -1
    for candidate in free:
        common = _common(cached[candidate], prompt, limit)
        if common > reused:
            slot, reused = candidate, common
    donor, donated = -1, reused + _MIN_COPY - 1
    for candidate, other in enumerate(slots):
        if other is not None:
            common = _common(cached[candidate], prompt, limit)
            if common > donated:
                donor, donated = candidate, common
    if donor >= 0:
        slot, reused = free[0], donated
    return slot, reused, donor


def _common(cached: Sequence[int], prompt: Sequence[int], limit: int) -> int:
    """The length of the common prefix of ``cached`` and ``prompt``, at most ``limit``."""
    n = min(len(cached), limit)
    i = 0
    while i < n and cached[i] == prompt[i]:
        i += 1
    return i


def compaction(slots: Sequence[Choice | None], remaining: int) -> tuple[Choice, int, int] | None:
    """``(sequence, from slot, to slot)``: the highest decoding sequence above the lowest
    free slot, to move down into it; None when there is no such gap.

    Why: llama.cpp puts only consecutive sequence ids into one micro-batch, so a free slot
    between running ones (a sequence in the middle finished) splits every step in two
    until a new request fills it. A move copies the sequence's cells once, a few ms; the
    split costs a micro-batch per step for the rest of its output. Only sequences with
    ``remaining`` tokens or more to go move, and never siblings of ``n > 1`` mid-copy.
    """
    free = next((slot for slot, seq in enumerate(slots) if seq is None), None)
    if free is None:
        return None
    for slot in range(len(slots) - 1, free, -1):
        seq = slots[slot]
        if (
            seq is not None
            and seq.pending is not None
            and seq.leader is None
            and not seq.followers
            and seq.budget - seq.generated >= remaining
        ):
            return seq, slot, free
    return None
