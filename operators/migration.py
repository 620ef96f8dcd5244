"""Migration: a worker lost mid-stream is invisible to the client.

Migration sits upstream of the Backend. When the downstream raises
:class:`~pipeline.WorkerLost` (at connect or mid-stream) it calls downstream again with a
child context and the request rewritten to continue where the lost worker stopped: the
prompt extended by every token id generated so far, ``max_tokens``/``min_tokens`` reduced
by that count, ``replayed_tokens`` telling the engine how much of the prompt is replayed
output. The Backend's decoder state is in the request's Context state, so the new attempt
resumes it: withheld text, detokenizer and counters carry over (see ``operators.backend``).
Migration is the retrier of the contract in :mod:`operators.contracts.resumption`: it arms
:data:`~operators.contracts.resumption.RESUMABLE` for each attempt, and must be linked upstream of
the Backend (it raises :class:`~operators.contracts.resumption.ResumptionOrderError` below one).

Traced, each attempt is a child span of Migration's (``attempt``, with
``llm_pipeline.attempt``, and for a lost worker the error, an event ``retry`` and
``llm_pipeline.retry_reason``); the stages below hang under their attempt.

It never migrates an n>1 request once an output of it has gone out (its choices' engine
state cannot be rebuilt from one prompt; lost before its first output, it is simply sent
again), a request the client cancelled, or one that would exceed the maximum sequence
length; and it lets every error that is not ``WorkerLost`` through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import aclosing
from typing import Literal

from pipeline import ConnectFailed, Context, Engine, Stream, WorkerLost

from .contracts.llm import BackendOutput, PreprocessedRequest
from .contracts.resumption import RESUMABLE, check_retrier, continuation

__all__ = ("Migration", "MigrationEvent")

logger = logging.getLogger(__name__)

MigrationEvent = Callable[[Literal["connect", "stream"], Literal["retried", "exhausted"]], None]
"""Called once per lost worker: where it was lost, and whether a retry was started."""


class Migration:
    """Operator: retry a request on another worker when its worker is lost.

    ``limit`` is how many retries one request may take (0 disables migration);
    ``max_seq_len`` (prompt plus output so far) past which a request is not migrated;
    ``on_event`` is told about each lost worker (metrics hook it here).
    """

    def __init__(
        self,
        limit: int = 3,
        *,
        max_seq_len: int | None = None,
        on_event: MigrationEvent | None = None,
    ) -> None:
        if limit < 0:
            raise ValueError(f"migration limit must be >= 0, got {limit}")
        self.limit = limit
        self._max_seq_len = max_seq_len
        self._on_event = on_event

    def _migratable(self, request: PreprocessedRequest) -> bool:
        return request.n == 1

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput]:
        """Stream ``ctx`` from downstream, retrying on ``WorkerLost``.

        Raises:
            ResumptionOrderError: this Migration is linked below the Backend.
        """
        check_retrier(ctx, self)
        original = ctx.data
        migratable = self._migratable(original)
        retries_left = self.limit
        generated: list[int] = []
        produced = False  # an output has gone out (an n>1 request is retried only before)
        attempt = original
        bounded = self._max_seq_len is not None  # else no per-output length check
        span = ctx.span
        number = 0
        while True:
            armed = (
                retries_left > 0
                and (migratable or not produced)
                and self._fits(original, generated)
            )
            ctx.state.set(RESUMABLE, armed)
            started = False
            number += 1
            attempt_span = None
            if span is not None:
                attempt_span = span.child("attempt")
                attempt_span.set("llm_pipeline.attempt", number)
                attempt_span.set("llm_pipeline.replayed_tokens", len(generated))
            try:
                leg = ctx.child(attempt)
                if attempt_span is not None:
                    leg = leg.with_span(attempt_span)
                async with aclosing(downstream.generate(leg)) as stream:
                    async for output in stream:
                        started = produced = True
                        generated.extend(output.token_ids)
                        if armed and not (
                            migratable and (not bounded or self._fits(original, generated))
                        ):
                            armed = False  # too long to replay, or n>1: the last attempt
                            ctx.state.set(RESUMABLE, False)
                        yield output
                return
            except WorkerLost as exc:
                where: Literal["connect", "stream"] = (
                    "connect" if isinstance(exc, ConnectFailed) or not started else "stream"
                )
                if attempt_span is not None:
                    attempt_span.set_error(f"worker lost at {where}: {exc}")
                if not armed or ctx.is_stopped:
                    if self._on_event is not None and (migratable or not produced):
                        self._on_event(where, "exhausted")
                    raise
                retries_left -= 1
                if attempt_span is not None:
                    reason = f"{type(exc).__name__} at {where}: {exc}"
                    attempt_span.set("llm_pipeline.retry_reason", reason)
                    attempt_span.add_event("retry", {"llm_pipeline.retry_reason": reason})
                logger.info(
                    "request %s: worker lost at %s after %d tokens (%s); retrying, %d left",
                    ctx.id,
                    where,
                    len(generated),
                    exc,
                    retries_left,
                )
                if self._on_event is not None:
                    self._on_event(where, "retried")
                attempt = continuation(original, generated)
            except Exception as exc:
                if attempt_span is not None:
                    attempt_span.set_error(f"{type(exc).__name__}: {exc}")
                raise
            finally:
                ctx.state.set(RESUMABLE, False)
                if attempt_span is not None:
                    attempt_span.end()

    def _fits(self, request: PreprocessedRequest, generated: list[int]) -> bool:
        if self._max_seq_len is None:
            return True
        return request.prompt_tokens + len(generated) < self._max_seq_len
