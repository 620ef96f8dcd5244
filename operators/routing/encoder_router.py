"""EncoderRouter: run a request's images on an encode worker before the LLM sees them.

An optional hop in front of the prefill/decode routers (Dynamo's ``EncoderRouter``)::

    request with images, no encoder_result
        --[encode leg: ctx.child(request), round-robin over the encode WorkerSet]-->
        <-- terminal output whose encoder_result is an object
    request + encoder_result --> downstream

It is a passthrough for text-only requests, for requests already encoded, and while the
encode WorkerSet has no members. Encoding is an optimisation, never a requirement: when
the encode leg fails (an error, or a terminal without an object-shaped ``encoder_result``)
the request goes on unchanged and the downstream worker encodes inline. Only cancellation
is not a failure: it propagates.

The encode leg is opened and fully consumed before this operator yields anything, so no
cancel scope or task group of it is ever held across a ``yield``.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import aclosing
from typing import Any, Literal, TypeAlias

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from pipeline import Context, Engine, RoundRobin, Router, Stream, WorkerSet, open_stream

__all__ = ("EncoderRouter", "RouterState")

logger = logging.getLogger(__name__)

RouterState: TypeAlias = Literal["pending", "active", "unavailable"]
"""A disaggregation hop's lifecycle: never had workers / has workers / lost them all."""


class EncoderRouter:
    """Operator: attach an encode worker's ``encoder_result`` to multimodal requests.

    ``workers`` is the encode WorkerSet, kept current by discovery; None means no encode
    workers will ever exist (a permanent passthrough).

    :attr:`state` is the WorkerSet's lifecycle (pending, active, unavailable), read from
    the set itself: no task watches membership, so there is nothing to stop or leak.
    """

    def __init__(self, workers: WorkerSet[PreprocessedRequest, EngineOutput] | None = None) -> None:
        #: the encode workers (None: never any)
        self.workers = workers
        self._router = None if workers is None else Router(workers, RoundRobin())

    @property
    def state(self) -> RouterState:
        """``"pending"`` (never had encode workers), ``"active"``, or ``"unavailable"``."""
        return "pending" if self.workers is None else self.workers.lifecycle

    def _should_encode(self, ctx: Context[PreprocessedRequest]) -> bool:
        request = ctx.data
        return (
            bool(request.multimodal)
            and request.encoder_result is None
            and not ctx.is_stopped
            and self.state == "active"
        )

    async def _encode(self, ctx: Context[PreprocessedRequest]) -> dict[str, Any] | None:
        """Run the encode leg; its encoder_result, or None when it failed (logged). A
        traced request's leg gets a span, ``encode``, naming the worker chosen."""
        leg = ctx.child(ctx.data)
        span = None if ctx.span is None else ctx.span.child("encode", kind="client")
        if span is None:
            return await self._run_encode(ctx, leg)
        try:
            result = await self._run_encode(ctx, leg.with_span(span))
            if result is None:
                span.set_error("encoding failed: the request is encoded inline")
            return result
        finally:
            span.end()

    async def _run_encode(
        self, ctx: Context[PreprocessedRequest], leg: Context[PreprocessedRequest]
    ) -> dict[str, Any] | None:
        """The encode leg ``leg``, run by the encode router; its result or None."""
        assert self._router is not None
        terminal: EngineOutput | None = None
        try:
            async with open_stream(self._router, leg) as stream:
                async for output in stream:
                    if output.finish_reason is not None:
                        terminal = output
                        break
        except Exception as exc:
            # Cancellation is not an Exception subclass under anyio: it propagates.
            logger.warning(
                "request %s: encode worker failed (%r); falling back to inline encoding",
                ctx.id,
                exc,
            )
            return None
        result = None if terminal is None else terminal.encoder_result
        if isinstance(result, dict):
            return result
        if not leg.is_stopped:  # (a stopped or killed request is not an encode failure)
            problem = (
                "no terminal output"
                if terminal is None
                else f"encoder_result is {type(result).__name__}, not an object"
            )
            logger.warning(
                "request %s: encode worker returned %s; falling back to inline encoding",
                ctx.id,
                problem,
            )
        return None

    def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, EngineOutput],
    ) -> Stream[EngineOutput]:
        """Encode ``ctx``'s images on an encode worker if possible, then serve downstream.

        A request with nothing to encode gets downstream's own stream: the router adds no
        hop per token (see :func:`pipeline.link`).
        """
        if self._should_encode(ctx):
            return self._encoded(ctx, downstream)
        return downstream.generate(ctx)

    async def _encoded(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, EngineOutput],
    ) -> Stream[EngineOutput]:
        result = await self._encode(ctx)
        if ctx.is_killed:
            return
        if result is not None:
            ctx = ctx.replace(dataclasses.replace(ctx.data, encoder_result=result))
        async with aclosing(downstream.generate(ctx)) as stream:
            async for output in stream:
                yield output

    def __repr__(self) -> str:
        return f"EncoderRouter({self.workers!r}, state={self.state!r})"
