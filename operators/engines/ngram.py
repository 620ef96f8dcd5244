"""Prompt-lookup (n-gram) speculation: draft tokens from the request's own history.

Why: a small model on a CPU spends most of a decode step on fixed overhead, so verifying
several drafted tokens in one batched step is nearly as cheap as one plain step. When the
output repeats its context (quoting, code edits, "repeat this passage"), the tokens that
followed the last occurrence of the current n-gram are a good guess. The engine verifies the
guess against greedy argmax and keeps the longest agreeing prefix, so output is unchanged.

Sans-IO and model-free: :class:`NgramProposer` is unit-tested without llama.cpp.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import final

__all__ = ("NgramProposer", "NgramSpeculation")


@dataclass(frozen=True, slots=True, kw_only=True)
class NgramSpeculation:
    """Prompt-lookup (n-gram) speculative decoding, for greedy requests.

    Before each step the engine looks for the most recent earlier occurrence of the last
    ``ngram_size`` tokens of the request's history (prompt + generated; optionally falling
    back to shorter n-grams down to ``min_ngram_size``) and proposes the tokens that followed
    it. One batched decode verifies them; the longest prefix that matches the model's own
    greedy choice is accepted, plus one token from the model. The output is the same as
    without speculation; only the speed changes. Requests that sample (temperature > 0)
    decode normally.

    On a CPU a verification batch costs about as much per token as it verifies (measured:
    9 tokens ~5x one token), so rejected drafts are expensive: the draft length adapts per
    request (+2 after a fully accepted draft, -1 after a rejection, between 1 and
    ``num_draft_tokens``), and short n-grams, which match often and predict badly, are off
    by default.
    """

    #: length of the n-gram looked up
    ngram_size: int = 3
    #: most tokens proposed per step
    num_draft_tokens: int = 8
    #: shortest n-gram tried when the longer ones have no earlier occurrence
    #: (None: ``ngram_size``, no fallback)
    min_ngram_size: int | None = None

    def __post_init__(self) -> None:
        if self.ngram_size < 1:
            raise ValueError(f"ngram_size must be >= 1, got {self.ngram_size}")
        if self.min_ngram_size is not None and not 1 <= self.min_ngram_size <= self.ngram_size:
            raise ValueError(
                f"min_ngram_size must be between 1 and ngram_size ({self.ngram_size}), "
                f"got {self.min_ngram_size}"
            )
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")

    def proposer(self, history: Iterable[int] = ()) -> NgramProposer:
        """A proposer with these settings over ``history``."""
        return NgramProposer(
            history,
            ngram_size=self.ngram_size,
            min_ngram_size=self.ngram_size if self.min_ngram_size is None else self.min_ngram_size,
        )


@final
class NgramProposer:
    """The draft source of :class:`NgramSpeculation` (sans-IO; no model, no event loop).

    Holds a request's committed history (prompt and accepted tokens; never unverified
    drafts) and an index from every n-gram in it to the position that followed its most
    recent occurrence, so a proposal costs a few dict lookups, not a scan of the history::

        proposer = NgramProposer([1, 2, 3, 9, 1, 2], ngram_size=2)
        proposer.propose(3)  # -> [3, 9, 1]: what followed the earlier "1 2"

    ``min_ngram_size`` (default: ``ngram_size``) lets it fall back to shorter n-grams.
    """

    __slots__ = ("_history", "_index", "_indexed", "_max_n", "_min_n")

    def __init__(
        self, history: Iterable[int] = (), *, ngram_size: int, min_ngram_size: int | None = None
    ) -> None:
        if min_ngram_size is None:
            min_ngram_size = ngram_size
        if not 1 <= min_ngram_size <= ngram_size:
            raise ValueError(
                f"need 1 <= min_ngram_size ({min_ngram_size}) <= ngram_size ({ngram_size})"
            )
        self._max_n = ngram_size
        self._min_n = min_ngram_size
        self._history: list[int] = list(history)
        # n-gram (a tuple; lengths never collide) -> index of the token that followed it
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    @property
    def history(self) -> Sequence[int]:
        """The committed tokens, oldest first."""
        return self._history

    def extend(self, tokens: Iterable[int]) -> None:
        """Commit ``tokens`` (accepted output) to the history."""
        self._history.extend(tokens)

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the tail."""
        history = self._history
        last = len(history) - 1
        if count <= 0 or last < 1:
            return []
        index = self._index
        max_n, min_n = self._max_n, self._min_n
        # Index the n-grams that end before the last token; a later occurrence overwrites an
        # earlier one, so lookups find the most recent.
        for end in range(self._indexed, last):
            for n in range(min_n, min(max_n, end + 1) + 1):
                index[tuple(history[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, last)
        for n in range(min(max_n, last), min_n - 1, -1):
            follow = index.get(tuple(history[last - n + 1 :]))
            if follow is not None:
                return history[follow : follow + count]
        return []
