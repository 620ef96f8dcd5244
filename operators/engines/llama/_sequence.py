"""One choice of one request as the scheduler sees it: stop rules, sampling, emission.

A sequence is sans-IO: it never touches llama.cpp. The scheduler feeds its tokens, hands it
rows of logits and keeps its KV cells; the sequence turns rows into an
:class:`~operators.contracts.llm.EngineOutput` (one token, or a burst of accepted drafts).
:class:`Choices` is the scheduler's bookkeeping of a job's sequences (the job itself, the
hand-off with the request's task, knows none).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Tokens
from typing import TYPE_CHECKING, Any, final

from operators.contracts.llm import EngineOutput, FinishReason, TopLogprobs
from operators.engines._reasoning_budget import ReasoningClock
from operators.engines.ngram import NgramSpeculation

from ._sampling import NO_TOKEN, Sampler, choice_generator, logprobs_of
from ._speculation import Drafter

try:
    import numpy as np
except ImportError:  # the [llama] extra is missing: LlamaEngine() says so before any use
    pass

if TYPE_CHECKING:
    from ._constraint import Matcher
    from ._job import Job
    from ._sampling import Row

__all__ = ("Choices", "Sequence")


@final
class Sequence:
    """Choice ``index`` of ``job``.

    ``slot`` is its KV sequence once placed. ``pending`` is the last emitted token: not in
    the KV cache yet, the next step feeds it (with any drafts behind it); None while the
    prompt is prefilled. ``leader`` is a sibling whose prompt this one will copy instead of
    prefilling it again (``n > 1``); ``followers`` are the siblings waiting on this one.
    """

    __slots__ = (
        "_clock",
        "_logprobs",
        "_matcher",
        "_min_tokens",
        "_sampler",
        "_stop_ids",
        "_suppress",
        "budget",
        "cached",
        "drafter",
        "followers",
        "generated",
        "index",
        "job",
        "leader",
        "pending",
        "produced",
        "prompt",
        "prompt_end",
        "slot",
    )

    def __init__(
        self,
        job: Job,
        index: int,
        *,
        eog: frozenset[int],
        n_vocab: int,
        speculation: NgramSpeculation | None,
    ) -> None:
        request = job.request
        stop = request.stop
        self.job = job
        self.index = index
        self.prompt = request.token_ids
        self.budget = job.budget
        self._logprobs = request.output.logprobs
        self._min_tokens = stop.min_tokens
        self._sampler = Sampler(request, choice_generator(request.sampling.seed, index))
        if index == 0 and job.rng_state is not None:  # continuing a prefill worker's draws
            self._sampler.set_rng_state(job.rng_state)
        #: where the prompt ends: positions from here on are output continued after a
        #: prefill worker's first token, fed like decode tokens
        self.prompt_end = len(self.prompt) - job.resumed
        #: the constraint's state for this choice: advanced by every emitted token only
        self._matcher: Matcher | None = None if job.matchers is None else job.matchers[index]
        #: the reasoning budget's count: past it, the end marker's tokens are forced
        self._clock: ReasoningClock | None = None
        budget = request.reasoning_budget
        if budget is not None:
            replayed = request.replayed_tokens
            self._clock = ReasoningClock(budget, self.prompt[len(self.prompt) - replayed :])
        eos = () if stop.ignore_eos else eog.union(stop.eos_token_ids)
        stop_ids = frozenset(eos).union(stop.stop_token_ids)
        self._stop_ids = stop_ids
        # Until min_tokens is reached no stop id may be generated at all (as in vLLM).
        self._suppress = np.array(sorted(i for i in stop_ids if 0 <= i < n_vocab), dtype=np.intp)
        self.drafter: Drafter | None = None
        if speculation is not None and self._sampler.greedy:
            self.drafter = Drafter(speculation, request.token_ids)
        self.generated = 0
        self.pending: int | None = None
        self.slot: int | None = None
        self.leader: Sequence | None = None
        self.followers: list[Sequence] = []
        #: outputs handed to the job (the scheduler's count; the job counts what was taken)
        self.produced = 0
        #: prompt tokens found in the slot's cells when placed, reported on the first
        #: output (then None)
        self.cached: int | None = None

    def rng_state(self) -> dict[str, Any] | None:
        """The random generator's state now (see :meth:`Sampler.rng_state`)."""
        return self._sampler.rng_state()

    @property
    def behind(self) -> int:
        """Outputs produced that the request's task has not taken yet."""
        return self.produced - self.job.consumed[self.index]

    def room(self, n_ctx: int, cached: int) -> int:
        """How many draft tokens may follow the pending one: the budget (the step emits a
        token of its own) and the context window (``cached`` cells are in use)."""
        return min(self.budget - self.generated - 1, n_ctx - cached - 1)

    def propose(self, room: int) -> list[int]:
        """Drafts to verify after the pending token (at most ``room``): the drafter's, cut
        at the first one the constraint rejects (it could never be accepted)."""
        if self.drafter is None:
            return []
        drafts = self.drafter.propose(room)
        matcher = self._matcher
        if matcher is not None and drafts:
            del drafts[matcher.valid_prefix(drafts) :]
        return drafts

    def emit(self, rows: Tokens[Row], drafts: Tokens[int]) -> tuple[EngineOutput, int]:
        """Choose a token from each row while the drafts match; how many drafts matched.

        ``rows[0]`` follows the pending token (or the prompt), ``rows[i]`` draft ``i - 1``.
        Under a constraint each chosen token advances the choice's matcher, and the choice
        ends (``"stop"``) once the grammar is complete and nothing but end-of-generation
        could follow: the engine does not spend a step on an EOS that is forced anyway.
        Past a reasoning budget the end marker's tokens are taken instead of sampled.
        """
        sampler = self._sampler
        matcher = self._matcher
        clock = self._clock
        k = self._logprobs
        token_ids: list[int] = []
        matched = False
        logprobs: list[float] | None = None if k is None else []
        top_logprobs: list[TopLogprobs] | None = None if k is None else []
        finish: FinishReason | None = None
        for position, row in enumerate(rows):
            forced = None if clock is None else clock.forced
            if forced is not None:
                token = forced
            else:
                suppressed = self._suppress if self.generated < self._min_tokens else None
                token = sampler.choose(row, suppressed, matcher)
            if token == NO_TOKEN:  # the constraint allows nothing: the output cannot go on
                finish = "stop"
                break
            if clock is not None:
                clock.advance(token)
            sampler.accept(token)
            token_ids.append(token)
            self.generated += 1
            if logprobs is not None and top_logprobs is not None and k is not None:
                logprob, top = logprobs_of(row, token, k)
                logprobs.append(logprob)
                top_logprobs.append(top)
            matched = position < len(drafts) and token == drafts[position]
            if token in self._stop_ids:
                finish = "stop"
                break
            if matcher is not None:
                matcher.accept(token)
                if matcher.ended:
                    finish = "stop"
                    break
            if self.generated >= self.budget:
                finish = "length"
                break
            if not matched:
                break
        if token_ids:
            self.pending = token_ids[-1]
        if self.drafter is not None:
            self.drafter.extend(token_ids)
        output = EngineOutput(token_ids, logprobs, top_logprobs, finish, self.index)
        if self.cached is not None:
            output.cached_tokens, self.cached = self.cached, None
        return output, max(len(token_ids) - 1 + matched, 0)


@final
class Choices:
    """A job's sequences as the scheduler tracks them: those waiting for a slot (in order),
    those in one, and how many are done."""

    __slots__ = ("finished", "queued", "running")

    def __init__(self, sequences: Iterable[Sequence]) -> None:
        self.queued: deque[Sequence] = deque(sequences)
        self.running: list[Sequence] = []
        self.finished = 0

    def clear(self) -> None:
        """Forget every choice not done (the job leaves the scheduler)."""
        self.queued.clear()
        self.running.clear()
