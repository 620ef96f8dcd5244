"""One choice's reasoning, counted against its budget: :class:`ReasoningClock`.

An engine that honours :class:`~operators.contracts.llm.ReasoningBudget` (the feature
``REASONING_BUDGET``) keeps one clock per choice, asks it before choosing each token which
token is :attr:`~ReasoningClock.forced` (None: the sampler chooses), and tells it every token
the choice took (:meth:`~ReasoningClock.advance`). The llama engine does this in its
sequences, the vLLM engine in a logits processor: the same clock, so both end reasoning at
the same token.

What counts, in tokens of the model's own tokenizer (no text, no parser):

- a choice is inside its reasoning from the first token when the prompt left it ``open``,
  or after the start marker's tokens; it leaves it after the end marker's tokens;
- every token taken inside counts, the end marker's own included; once ``tokens`` have
  been counted, the end marker is forced, one token a step, continued from whatever prefix
  of it the choice had already written (a model cut in the middle of ``</think>`` is not
  made to write ``</</think>``). A choice therefore reasons at most ``tokens`` plus the
  marker's length;
- the budget is for all of a choice's reasoning: a choice that opens its reasoning again
  after spending it is made to close it at once.

Markers are matched as the tokenizer spells them (the ids the frontend encoded): exact for
models whose markers are single special tokens (Qwen 3, DeepSeek R1). A model that writes a
marker in other tokens is not seen to open or close its reasoning; at worst a closed
reasoning is taken as still open, and the marker is forced where the budget runs out.

On a migration retry the choice's replayed output goes through the clock first, so a
retry continues the count where the first attempt stopped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import final

from operators.contracts.llm import PreprocessedRequest, ReasoningBudget
from pipeline import InvalidRequest

__all__ = ("ReasoningClock", "check_budget")


def check_budget(request: PreprocessedRequest, request_id: str) -> None:
    """Refuse a budget no engine can keep: one without an end marker, or one beside a
    constraint (the constraint covers the whole output, reasoning included, so forcing
    the marker would break it; the preprocessor refuses the pair first).

    Raises:
        InvalidRequest: naming the budget's field.
    """
    budget = request.reasoning_budget
    if budget is None:
        return
    problem = None
    if not budget.end:
        problem = "the reasoning format has no end marker to force"
    elif budget.tokens < 0:
        problem = f"the budget must be >= 0 tokens, got {budget.tokens}"
    elif request.constraint is not None:
        problem = f"it cannot be combined with '{request.constraint.param}'"
    if problem is not None:
        raise InvalidRequest(
            f"'{budget.param}': {problem}", param=budget.param, request_id=request_id
        )


@final
class ReasoningClock:
    """The reasoning of one choice under ``budget``, past ``replayed`` tokens (the output
    a migration retry replays)."""

    __slots__ = ("_end", "_inside", "_limit", "_start", "_tail", "spent")

    def __init__(self, budget: ReasoningBudget, replayed: Iterable[int] = ()) -> None:
        self._limit = budget.tokens
        self._start = budget.start
        self._end = budget.end
        self._inside = budget.open
        #: the last tokens taken, as many as the longer marker has
        self._tail: deque[int] = deque(maxlen=max(len(budget.start), len(budget.end), 1))
        #: tokens taken inside the reasoning so far
        self.spent = 0
        for token in replayed:
            self.advance(token)

    @property
    def inside(self) -> bool:
        """Whether the choice is reasoning now."""
        return self._inside

    @property
    def forced(self) -> int | None:
        """The token the choice must take next (None: whatever the sampler chooses)."""
        if not self._inside or self.spent < self._limit or not self._end:
            return None
        return self._end[_overlap(self._tail, self._end)]

    def advance(self, token: int) -> None:
        """The choice took ``token``."""
        tail = self._tail
        tail.append(token)
        if self._inside:
            self.spent += 1
            if _ends_with(tail, self._end):
                self._inside = False
        elif self._start and _ends_with(tail, self._start):
            self._inside = True


def _ends_with(tail: deque[int], marker: tuple[int, ...]) -> bool:
    size = len(marker)
    if not size or len(tail) < size:
        return False
    return all(tail[len(tail) - size + i] == marker[i] for i in range(size))


def _overlap(tail: deque[int], marker: tuple[int, ...]) -> int:
    """The longest proper prefix of ``marker`` that ``tail`` ends with (its length)."""
    for size in range(min(len(marker) - 1, len(tail)), 0, -1):
        if all(tail[len(tail) - size + i] == marker[i] for i in range(size)):
            return size
    return 0
