"""The token Backend: token ids in, text out, stop conditions enforced.

The Backend sits between the request-shaping operators and the engine. Forward it passes
the :class:`~operators.contracts.llm.PreprocessedRequest` on unchanged; backward it turns
each :class:`~operators.contracts.llm.EngineOutput` into a
:class:`~operators.contracts.llm.BackendOutput`:

* incremental detokenization (one :class:`~operators.text.detokenizer.IncrementalDecoder` per
  choice), so a character split across tokens arrives whole and never as U+FFFD;
* stop strings through a :class:`~operators.text.stop_jail.StopJail` per choice, which
  withholds exactly the text that may still become a hidden stop string;
* stop token ids (hidden: EOS and the user's; visible), ``min_tokens``, ``max_tokens``.

All per-choice decoder state lives in the request's Context state, not in the operator
and not in the stream: when a worker dies and Migration (upstream of us) calls downstream
again for the same request, this operator finds the state and resumes it. Withheld text,
detokenizer state and counters carry over; replayed token ids are never decoded twice.

Withheld text is released in generation order on every terminal path: a local stop, an
engine finish, a stream that ends without a finish reason (one synthetic "stop"), and an
error (flushed first, then the error propagates; no synthetic finish after an error). The
one exception is a lost worker while a retry is armed (:data:`RESUMABLE`): then the text
stays withheld for the next attempt, which may still complete a hidden stop string. That is
the resumer's side of the contract in :mod:`operators.contracts.resumption`: the Backend declares
itself for each request before it opens downstream, and a Migration linked below it
refuses the request with :class:`~operators.contracts.resumption.ResumptionOrderError`.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import aclosing
from typing import TYPE_CHECKING, Protocol

from pipeline import Context, Engine, StateKey, Stream, WorkerLost

from .contracts.llm import BackendOutput, EngineOutput, FinishReason, PreprocessedRequest
from .contracts.resumption import RESUMABLE, declare_resumer
from .text.detokenizer import PROMPT_CONTEXT_IDS
from .text.stop_jail import Released, StopJail, Stopped

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = (
    "CACHED_TOKENS",
    "RESUMABLE",
    "Backend",
    "BackendState",
    "ChoiceDecoder",
    "DetokenizerFactory",
)

logger = logging.getLogger(__name__)


class _Detokenizer(Protocol):
    def step(self, token_id: int, /) -> str | None: ...


class DetokenizerFactory(Protocol):
    """What the Backend needs from a tokenizer: a fresh incremental decoder per choice."""

    def decode_stream(
        self, *, skip_special_tokens: bool, prompt_ids: Sequence[int] = ()
    ) -> _Detokenizer: ...


class ChoiceDecoder:
    """The decoder state of one choice: detokenizer, stop jail, counters.

    ``step()`` is synchronous and does no I/O, so the stop logic is testable without an
    event loop.
    """

    __slots__ = (
        "_detok",
        "_eos",
        "_hidden_ids",
        "_jail",
        "_jail_active",
        "_max_tokens",
        "_min_tokens",
        "_pending",
        "_released",
        "_stop_ids",
        "_text_len",
        "_user_ids",
        "delivered",
        "finished",
        "generated",
        "index",
    )

    def __init__(self, request: PreprocessedRequest, detok: _Detokenizer, index: int) -> None:
        stop = request.stop
        self.index = index
        self._detok = detok
        self._jail = StopJail(stop.stop, include_stop_in_output=stop.include_stop_str_in_output)
        self._min_tokens = stop.min_tokens
        self._max_tokens = stop.max_tokens
        self._user_ids = frozenset(stop.stop_token_ids)
        self._eos = frozenset(() if stop.ignore_eos else stop.eos_token_ids)
        self._hidden_ids = self._user_ids | self._eos
        self._stop_ids = self._hidden_ids
        self._jail_active = self._jail.active
        #: tokens generated so far (every id the engine produced for this choice, once)
        self.generated = 0
        #: tokens whose text, or part of it, has been released
        self.delivered = 0
        self.finished = False
        self._text_len = 0  # characters of generated text
        self._released = 0  # characters released to the client
        self._pending: deque[int] = deque()  # start offsets of tokens not yet delivered

    @property
    def withheld(self) -> str:
        """Text generated but not released yet."""
        return self._jail.withheld

    def step(self, output: EngineOutput) -> BackendOutput:
        """Decode one engine output and apply the stop conditions."""
        ids = output.token_ids
        if len(ids) == 1 and output.text is None and output.finish_reason is None:
            # The common case, one token that cannot end the choice by its id or count,
            # takes a short path: the same state changes as the general one below.
            token_id = ids[0]
            generated = self.generated + 1
            max_tokens = self._max_tokens
            if (
                generated > self._min_tokens
                and token_id not in self._stop_ids
                and (max_tokens is None or generated < max_tokens)
            ):
                piece = self._detok.step(token_id) or ""
                result = self._jail.push(piece) if self._jail_active else None
                if result is None or type(result) is not Stopped:
                    self.generated = generated
                    pending = self._pending
                    pending.append(self._text_len)
                    self._text_len += len(piece)
                    text = piece if result is None else result.text
                    released = self._released = self._released + len(text)
                    while pending and pending[0] < released:
                        pending.popleft()
                        self.delivered += 1
                    # positional (half the cost): ids, tokens, text, logprobs, top_logprobs,
                    # finish_reason, stop_reason, index, delivered_tokens
                    return BackendOutput(
                        ids,
                        [piece],
                        text,
                        output.logprobs,
                        output.top_logprobs,
                        None,
                        None,
                        self.index,
                        self.delivered,
                    )
                return self._general(output, piece, result)
        return self._general(output, None, None)

    def _general(
        self, output: EngineOutput, first_piece: str | None, first_result: Stopped | None
    ) -> BackendOutput:
        """Any output: ``first_piece`` and ``first_result`` are the already decoded and
        jailed first token when the short path found that it completes a stop string."""
        ids = output.token_ids
        tokens: list[str] = []
        text_parts: list[str] = []
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        swallow_from: int | None = None  # char offset from which text is swallowed
        engine_text = output.text
        count = 0
        for position, token_id in enumerate(ids):
            count = position + 1
            self.generated += 1
            if first_piece is not None and position == 0:
                piece = first_piece
            elif engine_text is not None:
                piece = engine_text if position == 0 else ""
            else:
                piece = self._detok.step(token_id) or ""
            tokens.append(piece)
            start = self._text_len
            self._pending.append(start)
            self._text_len += len(piece)
            if self.generated <= self._min_tokens:
                text_parts.append(piece)
                self._released += len(piece)
            elif token_id in self._hidden_ids:
                flushed = self._jail.flush()
                text_parts.append(flushed)
                self._released += len(flushed)
                finish, stop_reason = "stop", (token_id if token_id in self._user_ids else None)
                swallow_from = start
                break
            else:
                if first_result is not None and position == 0:
                    result: Released | Stopped = first_result
                else:
                    result = self._jail.push(piece)
                text_parts.append(result.text)
                self._released += len(result.text)
                if isinstance(result, Stopped):
                    finish, stop_reason = "stop", result.stop
                    if not self._jail.include_stop_in_output:
                        swallow_from = self._released
                    break
            if self._max_tokens is not None and self.generated >= self._max_tokens:
                finish = "length"
                break
        if count < len(ids):  # a burst that ran past a stop: the rest was never output
            ids = ids[:count]
        if finish is None and output.finish_reason is not None:
            finish = output.finish_reason
        if finish is not None:
            self.finished = True
            if swallow_from is None:
                flushed = self._jail.flush()
                text_parts.append(flushed)
                self._released += len(flushed)
            self._deliver(final=swallow_from is None)
        else:
            self._deliver(final=False)
        logprobs = output.logprobs
        top = output.top_logprobs
        if len(ids) != len(output.token_ids):
            logprobs = None if logprobs is None else logprobs[: len(ids)]
            top = None if top is None else top[: len(ids)]
        return BackendOutput(
            token_ids=ids,
            tokens=tokens,
            text="".join(text_parts),
            logprobs=logprobs,
            top_logprobs=top,
            finish_reason=finish,
            stop_reason=stop_reason,
            index=self.index,
            delivered_tokens=self.delivered,
        )

    def flush(self, finish: FinishReason | None) -> BackendOutput:
        """Release all withheld text: the stream ended (``"stop"``) or failed (None)."""
        text = self._jail.flush()
        self._released += len(text)
        if finish is not None:
            self.finished = True
        self._deliver(final=True)
        return BackendOutput(
            token_ids=[],
            tokens=[],
            text=text,
            finish_reason=finish,
            index=self.index,
            delivered_tokens=self.delivered,
        )

    def _deliver(self, *, final: bool) -> None:
        pending = self._pending
        released = self._released
        while pending and (pending[0] < released or final):
            pending.popleft()
            self.delivered += 1


class BackendState:
    """Every choice's decoder for one request, kept in the request's Context state."""

    __slots__ = ("choices",)

    def __init__(self) -> None:
        self.choices: dict[int, ChoiceDecoder] = {}


_STATE = StateKey[BackendState]("backend.state")

#: prompt tokens the engine last reported finding in its prefix cache for this request
#: (``EngineOutput.cached_tokens``; a retry's report replaces the first attempt's), kept in
#: the request's state for whoever reports usage (the OpenAI preprocessor)
CACHED_TOKENS = StateKey[int]("backend.cached_tokens")


class Backend:
    """Operator: EngineOutput token ids -> BackendOutput text, with stop conditions.

    ``tokenizer`` provides ``decode_stream(skip_special_tokens=..., prompt_ids=...)``
    (:class:`operators.text.tokenizer.Tokenizer` does).
    """

    def __init__(self, tokenizer: DetokenizerFactory) -> None:
        self._tokenizer = tokenizer

    def _choice(
        self, state: BackendState, request: PreprocessedRequest, index: int
    ) -> ChoiceDecoder:
        choice = state.choices.get(index)
        if choice is None:
            end = request.prompt_tokens  # (a slice of the end only: prompts can be millions)
            detok = self._tokenizer.decode_stream(
                skip_special_tokens=request.output.skip_special_tokens,
                prompt_ids=request.token_ids[max(0, end - PROMPT_CONTEXT_IDS) : end],
            )
            choice = state.choices[index] = ChoiceDecoder(request, detok, index)
        return choice

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, EngineOutput],
    ) -> Stream[BackendOutput]:
        """Decode the downstream stream for ``ctx`` (resuming earlier attempts' state)."""
        request = ctx.data
        state = ctx.state.setdefault(_STATE, BackendState())
        declare_resumer(ctx, self)
        n = request.n
        leg = ctx.child(request)
        try:
            async with aclosing(downstream.generate(leg)) as stream:
                async for output in stream:
                    if output.cached_tokens is not None:
                        ctx.state.set(CACHED_TOKENS, output.cached_tokens)
                    choice = state.choices.get(output.index)
                    if choice is None:
                        choice = self._choice(state, request, output.index)
                    elif choice.finished:
                        continue
                    yield choice.step(output)
                    if choice.finished and _all_finished(state, n):
                        # Every choice stopped here: the engine may still be producing.
                        leg.stop_generating()
                        return
        except Exception as exc:
            if not (isinstance(exc, WorkerLost) and ctx.state.get(RESUMABLE, False)):
                for choice in list(state.choices.values()):
                    if not choice.finished and choice.withheld:
                        yield choice.flush(None)
            raise
        if ctx.is_killed:
            # Killed (a deadline, a drain's abort, a client gone): an engine that saw it
            # before the cancellation did ends quietly, which is no finish to report.
            return
        for index in range(n):  # the stream ended without finishing these choices
            choice = self._choice(state, request, index)
            if not choice.finished:
                yield choice.flush("stop")


def _all_finished(state: BackendState, n: int) -> bool:
    choices = state.choices
    return all(i in choices and choices[i].finished for i in range(n))
