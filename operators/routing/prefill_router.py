"""PrefillRouter: disaggregated serving, prefill on one worker and decode on another.

It sits between the request-shaping operators and the decode router (Dynamo's
``PrefillRouter``, "completed/pull" handoff)::

    request --[prefill leg: ctx.child, max_tokens=1, a policy over the prefill set]-->
            <-- the first token + a transfer handle (EngineOutput.prefill_result)
    request + prefill_result --> downstream (decode)
    client  <-- first token, then the decode stream (which continues after it)

Every token reaches the caller exactly once: the first from the prefill leg, the rest from
the decode worker, which skips what the handle says was already produced. When the first
token already ends the request (its finish_reason is "stop" and the request has no
``min_tokens``, or the request asked for one token) that output is the whole answer and
decode is never called.

Requests are served aggregated (a passthrough) when the prefill WorkerSet has no members,
when the prompt is shorter than ``min_prompt_tokens`` (conditional disaggregation: a short
prefill is cheaper than the handoff), for n>1 (one handle cannot seed several choices),
for ``max_tokens=0``, and when the request already carries a handle.

The prefill leg is a child context driven by :func:`pipeline.open_stream` and consumed
completely before the first ``yield``, so a kill of the request reaches it and no cancel
scope is held across a ``yield``. Its errors propagate unchanged: a lost prefill worker is
:class:`pipeline.WorkerLost`, which Migration (upstream) retries; no token was delivered,
so none is lost or repeated.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import aclosing

from operators.contracts.llm import EngineOutput, PreprocessedRequest, TopLogprobs
from pipeline import (
    Context,
    Engine,
    EngineError,
    RoundRobin,
    Router,
    RoutingPolicy,
    Stream,
    WorkerSet,
    open_stream,
)

from .encoder_router import RouterState

__all__ = ("PrefillRouter",)

logger = logging.getLogger(__name__)


class PrefillRouter:
    """Operator: prefill on a prefill worker, then decode downstream with its handle.

    ``workers`` is the prefill WorkerSet, kept current by discovery (None: always
    aggregated). ``min_prompt_tokens``: prompts with fewer tokens to prefill (prompt plus
    replayed output) are served aggregated. ``policy`` picks the prefill worker (default:
    round-robin); a :class:`pipeline.KvRouter` sends each prompt to the prefill worker that
    caches its longest prefix, where most of the work it saves is (the prefill leg is the
    whole prompt; decode computes none of it).

    :attr:`state` follows the WorkerSet's membership, computed when read (no watcher
    task; see :class:`operators.routing.encoder_router.EncoderRouter`).
    """

    def __init__(
        self,
        workers: WorkerSet[PreprocessedRequest, EngineOutput] | None = None,
        *,
        min_prompt_tokens: int = 0,
        policy: RoutingPolicy | None = None,
    ) -> None:
        if min_prompt_tokens < 0:
            raise ValueError(f"min_prompt_tokens must be >= 0, got {min_prompt_tokens}")
        #: the prefill workers (None: never any)
        self.workers = workers
        self.min_prompt_tokens = min_prompt_tokens
        #: how the prefill worker is picked
        self.policy: RoutingPolicy = RoundRobin() if policy is None else policy
        self._router = None if workers is None else Router(workers, self.policy)

    @property
    def state(self) -> RouterState:
        """``"pending"`` (never had prefill workers), ``"active"``, or ``"unavailable"``."""
        return "pending" if self.workers is None else self.workers.lifecycle

    def _disaggregate(self, request: PreprocessedRequest) -> bool:
        max_tokens = request.stop.max_tokens
        return (
            request.n == 1
            and request.prefill_result is None
            and (max_tokens is None or max_tokens > 0)
            and len(request.token_ids) >= self.min_prompt_tokens
            and self.state == "active"
        )

    async def _prefill(self, ctx: Context[PreprocessedRequest]) -> EngineOutput | None:
        """Run the prefill leg to its end; one output holding its token and handle.

        None when the request was stopped or killed before the token arrived. A traced
        request's leg gets a span, ``prefill``, naming the worker chosen (and, under a
        :class:`pipeline.KvRouter`, the KV overlap it had).
        """
        request = ctx.data
        # The first token is chosen as the aggregated request's would be: with min_tokens
        # its stop ids are masked out.
        stop = dataclasses.replace(
            request.stop, max_tokens=1, min_tokens=min(request.stop.min_tokens, 1)
        )
        leg = ctx.child(dataclasses.replace(request, stop=stop, prefill_result=None))
        span = None if ctx.span is None else ctx.span.child("prefill", kind="client")
        if span is not None:
            leg = leg.with_span(span)
        try:
            first = await self._run_prefill(ctx, leg)
            if span is not None and first is not None and first.cached_tokens is not None:
                span.set("gen_ai.usage.cache_read.input_tokens", first.cached_tokens)
        except Exception as exc:
            if span is not None:
                span.set_error(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if span is not None:
                span.end()
        return first

    async def _run_prefill(
        self, ctx: Context[PreprocessedRequest], leg: Context[PreprocessedRequest]
    ) -> EngineOutput | None:
        """The prefill leg ``leg`` (traced under its own span, when ``ctx`` is), run to its
        end by the prefill router."""
        assert self._router is not None
        token_ids: list[int] = []
        logprobs: list[float] = []
        top_logprobs: list[TopLogprobs] = []
        text: list[str] = []
        finish = None
        handle = None
        cached = None
        async with open_stream(self._router, leg) as stream:
            async for output in stream:
                if output.index != 0:
                    continue
                token_ids.extend(output.token_ids)
                if output.logprobs is not None:
                    logprobs.extend(output.logprobs)
                if output.top_logprobs is not None:
                    top_logprobs.extend(output.top_logprobs)
                if output.text is not None:
                    text.append(output.text)
                if output.prefill_result is not None:
                    handle = output.prefill_result
                if output.finish_reason is not None:
                    finish = output.finish_reason
                if output.cached_tokens is not None:
                    cached = output.cached_tokens
        if not token_ids and leg.is_stopped:
            return None
        if len(token_ids) != 1:
            raise EngineError(
                f"prefill worker returned {len(token_ids)} tokens for a max_tokens=1 leg",
                request_id=ctx.id,
            )
        return EngineOutput(
            token_ids=token_ids,
            logprobs=logprobs or None,
            top_logprobs=top_logprobs or None,
            finish_reason=finish,
            text="".join(text) if text else None,
            prefill_result=handle,
            cached_tokens=cached,
        )

    def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, EngineOutput],
    ) -> Stream[EngineOutput]:
        """Serve ``ctx`` disaggregated when prefill workers exist, else aggregated.

        An aggregated request gets downstream's own stream: the router adds no hop per
        token (see :func:`pipeline.link`).

        Raises:
            EngineError: the prefill worker returned no token, or no object-shaped
                transfer handle for a request that needs decoding.
        """
        if self._disaggregate(ctx.data):
            return self._disaggregated(ctx, downstream)
        return downstream.generate(ctx)

    async def _disaggregated(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, EngineOutput],
    ) -> Stream[EngineOutput]:
        request = ctx.data
        first = await self._prefill(ctx)
        if first is None:
            return
        handle = first.prefill_result
        first.prefill_result = None
        # A "stop" ends the request only when the request allows a stop at its first
        # token (under min_tokens the leg's stop can only be a constraint's end).
        stopped = first.finish_reason == "stop" and request.stop.min_tokens == 0
        if stopped or request.stop.max_tokens == 1:
            # The first token ends the request: there is nothing to decode.
            first.finish_reason = first.finish_reason or "length"
            yield first
            return
        first.finish_reason = None
        if not isinstance(handle, dict):
            raise EngineError(
                "prefill worker returned no transfer handle (prefill_result is "
                f"{type(handle).__name__}, not an object)",
                request_id=ctx.id,
            )
        # Decode is routed even if the request was stopped meanwhile, so the decode
        # side can release the transfer; a stopped stream ends at once.
        ctx = ctx.replace(dataclasses.replace(request, prefill_result=handle))
        async with aclosing(downstream.generate(ctx)) as stream:
            yield first
            async for output in stream:
                yield output

    def __repr__(self) -> str:
        return (
            f"PrefillRouter({self.workers!r}, min_prompt_tokens={self.min_prompt_tokens}, "
            f"state={self.state!r})"
        )
