"""The resumption contract between a retrying operator (Migration) and a resuming one (Backend).

When a worker is lost mid-stream, :class:`~operators.migration.Migration` calls downstream
again with a continuation request; the :class:`~operators.backend.Backend` below it keeps
the request's decoder state in the Context, so the new attempt resumes it (withheld text,
detokenizer, counters). One question is left between them: when the Backend sees
:class:`~pipeline.WorkerLost`, is a retry coming? If so it must keep the text it withholds
(the next attempt may still complete a hidden stop string); if not it must flush it before
the error propagates, as on any other error. The two answer it through the request's
:class:`~pipeline.State`, in one direction only:

1. The **retrier** (upstream) sets :data:`RESUMABLE` before every attempt: True while a
   ``WorkerLost`` from this attempt will be retried, False once it will not (limit
   reached, request too long to replay, the attempt finished). It is False again when the
   retrier's stream ends, however it ends.
2. The **resumer** (downstream) calls :func:`declare_resumer` before it opens its own
   downstream, and reads :data:`RESUMABLE` when ``WorkerLost`` reaches it.

So the contract holds only with the retrier upstream of the resumer:
``link(..., Migration(), Backend(tokenizer), ..., engine)``. The other way round the
Backend would decode a stream it never sees fail, under a retrier that rewrites requests
from outputs that are not the Backend's exact token record; :func:`check_retrier` makes a
retrier refuse to run below a declared resumer with :class:`ResumptionOrderError`. (mypy
rejects that graph too: the two operators' item types do not fit in that order.)

A retrier with no resumer below it is allowed: its downstream then simply has no withheld
text to keep, and continues from ``replayed_tokens`` on its own (a scripted test engine, a
custom operator that keeps no state).
"""

from __future__ import annotations

import dataclasses

from pipeline import Context, LinkError, StateKey

from .llm import PreprocessedRequest, StopConditions

__all__ = ("RESUMABLE", "ResumptionOrderError", "check_retrier", "continuation", "declare_resumer")

#: Set by the retrier (Migration) before each attempt: True while a lost worker will be
#: retried, so the resumer (Backend) keeps withheld text for the next attempt.
RESUMABLE = StateKey[bool]("backend.resumable")

#: Set by the resumer before it opens downstream: the name of the operator that resumes
#: this request's state across retries.
_RESUMER = StateKey[str]("resumption.resumer")


class ResumptionOrderError(LinkError):
    """A retrying operator is linked downstream of the operator that resumes its retries.

    Raised on the request's first use of the graph (the order cannot be seen at link time:
    it is the request's own state that tells). The message names both operators and the
    right order.
    """


def declare_resumer(ctx: Context[object], resumer: object) -> None:
    """Say that ``resumer`` keeps ``ctx``'s state across retries (call before downstream)."""
    ctx.state.setdefault(_RESUMER, type(resumer).__name__)


def check_retrier(ctx: Context[object], retrier: object) -> None:
    """Refuse to retry below a resumer: it would never hear of the retries.

    Raises:
        ResumptionOrderError: a resumer upstream of ``retrier`` declared itself for ``ctx``.
    """
    resumer = ctx.state.get(_RESUMER, None)
    if resumer is None:
        return
    name = type(retrier).__name__
    raise ResumptionOrderError(
        f"{name} is linked downstream of {resumer} (request {ctx.id}), but {resumer} "
        f"resumes what {name} retries, so it must be below it: "
        f"link(..., {name}(...), {resumer}(...), ..., engine)"
    )


def continuation(original: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request that continues ``original`` after ``generated`` output tokens: the
    prompt extended by them, ``max_tokens``/``min_tokens`` reduced by their count, and
    ``replayed_tokens`` saying so. What Migration sends after a lost worker, and what a
    decode worker runs after a prefill worker's first token."""
    done = len(generated)
    max_tokens = original.stop.max_tokens
    stop: StopConditions = dataclasses.replace(
        original.stop,
        max_tokens=None if max_tokens is None else max(0, max_tokens - done),
        min_tokens=max(0, original.stop.min_tokens - done),
    )
    return dataclasses.replace(
        original,
        token_ids=[*original.token_ids, *generated],
        replayed_tokens=original.replayed_tokens + done,
        stop=stop,
    )
