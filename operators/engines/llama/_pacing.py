"""How many prompt tokens a step may take while other sequences wait for their next token.

Why by time and not by tokens alone: a running sequence's inter-token latency is the length
of the steps it rides in, and a step costs about a decode step plus a fixed time per prompt
token (on a compute-bound CPU, whatever the chunk size above a few dozen). With a target
step time (``step_ms``) the pacer sizes prompt chunks so that steps holding them stay near
the target: small chunks while many sequences decode (their step is already long), large
ones while few do. It learns both costs from the steps it sees (exponentially weighted),
so it follows the machine's load; until it has seen a step of each kind it allows the
token budget.
"""

from __future__ import annotations

from typing import Final, final

from ._steps import LlamaStep

__all__ = ("MIN_CHUNK", "Pacer")

#: the smallest prompt chunk a step takes while others decode: a prompt must advance, and
#: a chunk's own overhead (one more sequence in the batch) should stay small beside it
MIN_CHUNK: Final = 16
#: how much a new step's measurement counts against the running estimate
_WEIGHT: Final = 0.2


@final
class Pacer:
    """Learns step costs; :meth:`prefill_budget` says how many prompt tokens fit."""

    __slots__ = ("_decode", "_per_token", "target")

    def __init__(self, step_ms: float) -> None:
        #: seconds a step beside decoding sequences should take at most (0: no pacing)
        self.target = step_ms / 1000
        self._decode: dict[int, float] = {}  # decode-only step seconds by batch size
        self._per_token: float | None = None  # seconds per prompt token

    def record(self, step: LlamaStep) -> None:
        """Learn from a step that ran."""
        sequences = len(step.decoded)
        if not step.prefill_tokens:
            if sequences:
                self._decode[sequences] = _average(self._decode.get(sequences), step.seconds)
            return
        base = self._base(sequences)
        if base is None and sequences:
            return
        per_token = max(step.seconds - (base or 0.0), 0.0) / step.prefill_tokens
        self._per_token = _average(self._per_token, per_token)

    def prefill_budget(self, decoding: int, most: int) -> int:
        """Prompt tokens a step with ``decoding`` decoding sequences may take (at most
        ``most``, at least :data:`MIN_CHUNK` or ``most`` if less)."""
        if not self.target or not decoding or self._per_token is None:
            return most
        base = self._base(decoding)
        if base is None:
            return most
        fits = int((self.target - base) / self._per_token) if self._per_token else most
        return max(min(fits, most), min(MIN_CHUNK, most))

    def _base(self, sequences: int) -> float | None:
        """A decode-only step's seconds with ``sequences`` sequences (the nearest size
        seen, scaled)."""
        known = self._decode
        if sequences in known:
            return known[sequences]
        if not known:
            return None
        nearest = min(known, key=lambda size: abs(size - sequences))
        return known[nearest] * sequences / nearest


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _WEIGHT * (new - old)
