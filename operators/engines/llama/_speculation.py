"""The engine's side of prompt-lookup speculation: one drafter per greedy sequence.

:class:`~operators.engines.ngram.NgramProposer` (sans-IO, model-free) finds the drafts;
this module decides how many to ask for. The scheduler puts every sequence's pending token
and drafts into the same step, so the drafts of several sequences are verified by one
``llama_decode``, and keeps only the accepted prefix of each in the KV cache.

Why the draft length adapts: on a CPU a verification batch costs about as much per token as
it verifies, so rejected drafts cost real time. It grows by 2 after a fully accepted draft
and shrinks by 1 after a rejection, between 1 and ``num_draft_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from operators.engines.ngram import NgramSpeculation

__all__ = ("Drafter",)


@final
class Drafter:
    """Drafts for one sequence from its own committed history (prompt + accepted output)."""

    __slots__ = ("_limit", "_proposer", "length")

    def __init__(self, speculation: NgramSpeculation, history: Sequence[int]) -> None:
        self._proposer = speculation.proposer(history)
        self._limit = speculation.num_draft_tokens
        #: how many drafts the next step asks for at most
        self.length = speculation.num_draft_tokens

    def propose(self, room: int) -> list[int]:
        """Up to ``min(room, length)`` draft tokens (none when nothing matches)."""
        return self._proposer.propose(min(room, self.length)) if room > 0 else []

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit emitted tokens to the history."""
        self._proposer.extend(tokens)

    def settle(self, proposed: int, accepted: int) -> None:
        """Adapt the draft length to how the last verification went."""
        if accepted == proposed:
            self.length = min(self.length + 2, self._limit)
        else:
            self.length = max(self.length - 1, 1)
