"""Operators that change the text a client reads, without leaking what they changed.

A :class:`~operators.contracts.llm.BackendOutput` says the same thing three ways: ``text`` (what the
client reads now), ``token_ids``/``tokens`` (what the engine generated, counted in usage)
and ``logprobs``/``top_logprobs`` (which the OpenAI edge turns into per-token entries,
token text and bytes included, once ``delivered_tokens`` says the token's text reached the
client). An operator that rewrites only ``text`` -- a redactor, a profanity filter, a
translator -- still lets the original tokens through the logprobs. The rule:

* **Logprobs follow the text.** A token's logprob entry may reach the client only if the
  client also reads that token's own text.
* So an operator that may rewrite text it has not decided on yet holds *whole outputs*
  (not just their text) until it decides, then yields them as one with :func:`joined`:
  verbatim, logprobs and all, or rewritten with :func:`rewritten`, which hides the
  logprobs of every token it covers. Usage still counts those tokens; ``delivered_tokens``
  stays the Backend's count, so nothing else waits for them.

**Where it goes: above Migration** (between the preprocessor and Migration). There a lost
worker is invisible: Migration retries below, the operator's generator keeps running, and
what it holds stays in its locals. Below Migration it must not hold token ids at all:
Migration replays exactly the tokens that passed it, so held tokens would be generated
again on the next worker (the Backend therefore withholds *text* but passes every token id
up at once, with ``delivered_tokens`` saying which have been shown).

**Testing it**: ``check_operator(Redact, request, outputs)``, *without* ``retry=True``.
That option plays what Migration does to the operators below it (a new operator per
attempt, whose state must come back from ``ctx.state``); above Migration no retry reaches
the operator, so its locals are the right place for what it holds, and ``retry=True``
would fail it for a retry that never happens. To see it survive a lost worker, put it
above a real Migration, as ``tests/operators/contracts/test_rewriting.py`` does.

Both helpers return new outputs and never mutate their arguments.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .llm import BackendOutput

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("joined", "rewritten")


def joined(outputs: Sequence[BackendOutput]) -> BackendOutput:
    """One output for several consecutive outputs of one choice, in order.

    Token ids, token texts and text are concatenated; logprobs too when every output has
    them (otherwise none: an entry is never made up); ``finish_reason``, ``stop_reason``
    and ``delivered_tokens`` are the last output's, as they are cumulative or final.
    """
    if not outputs:
        raise ValueError("joined() needs at least one output")
    first, last = outputs[0], outputs[-1]
    if len(outputs) == 1:
        return first
    if any(output.index != first.index for output in outputs):
        raise ValueError("joined() takes outputs of one choice (their index differs)")
    if any(output.finish_reason is not None for output in outputs[:-1]):
        raise ValueError("joined() outputs after a finished one: only the last may finish")
    token_ids = [token for output in outputs for token in output.token_ids]
    tokens = [text for output in outputs for text in output.tokens]
    logprobs = None
    if all(output.logprobs is not None for output in outputs):
        logprobs = [value for output in outputs for value in output.logprobs or ()]
    top_logprobs = None
    if all(output.top_logprobs is not None for output in outputs):
        top_logprobs = [top for output in outputs for top in output.top_logprobs or ()]
    return BackendOutput(
        token_ids,
        tokens,
        "".join(output.text for output in outputs),
        logprobs,
        top_logprobs,
        last.finish_reason,
        last.stop_reason,
        first.index,
        last.delivered_tokens,
    )


def rewritten(output: BackendOutput, text: str) -> BackendOutput:
    """``output`` showing ``text`` instead, its tokens' logprobs hidden.

    The tokens stay (usage counts them, ``finish_reason`` and ``delivered_tokens`` are
    unchanged); their text and logprobs never reach the client, so nothing of what was
    rewritten leaks. Hold every output whose text you may rewrite and :func:`joined` them
    first: a token whose output went out before the decision has already shown its
    logprobs.
    """
    return replace(output, text=text, logprobs=None, top_logprobs=None)
