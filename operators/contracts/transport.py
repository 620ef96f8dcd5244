"""The LLM layer over the NATS transport: its codec, request log, and discovered worker sets.

What ``llm-pipeline worker`` and ``llm-pipeline serve --nats`` are made of::

    worker process      engine --[RequestLog]--> pipeline.transports.nats.serve(codec=llm_codec())
                                                 registered as (model, role) in JetStream KV
    frontend process    discover_workers(nc, model) -> WorkerSets(decode, prefill, encode)
                        default_graph(Router(decode, RetryElsewhere()), prefill_workers=...,
                                      encode_workers=...)

Workers serve raw engines (``PreprocessedRequest`` in, ``EngineOutput`` out). Everything
that keeps per-request state (the Backend, Migration, the OpenAI preprocessor) stays on the
frontend, in front of the routers, because a Context's state store does not travel.

- :func:`llm_codec` is the :class:`~pipeline.transports.codec.DataclassCodec` of this
  layer's hot-path types; a worker and its frontends must use the same one.
- :func:`coalesce_outputs` merges the token outputs a worker sent together (one BATCH
  frame) into bursts, so the frontend's graph handles one item where it had several.
- :class:`RequestLog` counts a worker's requests in flight and logs how each one ended
  (finished, stopped, cancelled, failed) at info level: a cancelled line is how one sees,
  from outside, that a client's disconnect reached the worker.
- :func:`discover_workers` follows the registrations of one model and keeps three
  WorkerSets current: decode (aggregated and decode workers together), prefill, encode.
- :class:`RetryElsewhere` is the frontend's decode routing policy: round-robin, except
  that a retry goes to a worker the request has not tried. Discovery evicts a worker
  killed outright at the first "no responders" (for every router and policy, the encode
  and prefill routers' plain round-robin included); this policy also covers deaths that
  answer no "no responders", like a worker that stopped answering pings.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

import anyio

from pipeline import Context, Engine, Stream, WorkerSet
from pipeline.transports.codec import DataclassCodec
from pipeline.transports.nats import NatsDiscovery, NatsTimeouts

from .llm import (
    BackendOutput,
    Constraint,
    EngineOutput,
    MultimodalItem,
    OutputOptions,
    PreprocessedRequest,
    ReasoningBudget,
    SamplingOptions,
    StopConditions,
    Tool,
    ToolCallDelta,
)
from .retry_elsewhere import RetryElsewhere as RetryElsewhere

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = (
    "LLM_TYPES",
    "RequestLog",
    "RetryElsewhere",
    "WorkerSets",
    "coalesce_outputs",
    "discover_workers",
    "llm_codec",
)

logger = logging.getLogger(__name__)

#: the dataclasses that cross a process boundary between the LLM operators and engines
LLM_TYPES: Final = (
    PreprocessedRequest,
    StopConditions,
    SamplingOptions,
    OutputOptions,
    MultimodalItem,
    Tool,
    Constraint,
    ReasoningBudget,
    EngineOutput,
    BackendOutput,
    ToolCallDelta,
)


def llm_codec() -> DataclassCodec:
    """A new codec for :data:`LLM_TYPES` (a codec is a buffer: one per event loop)."""
    return DataclassCodec(LLM_TYPES)


def coalesce_outputs(outputs: list[EngineOutput]) -> list[EngineOutput]:
    """``outputs`` (ready together, in order) with each run of consecutive token outputs
    of one choice merged into one output: a burst, as a speculating engine yields.

    The frontend's graph takes a burst as the tokens one by one: the Backend decodes,
    counts and checks each token of an output in turn (the stop jail, stop ids, EOS,
    ``min_tokens``, ``max_tokens``) and cuts a burst at the token that stops it, with its
    logprobs (aligned with the ids, concatenated here); usage is the sum of the ids;
    Migration replays every id it has seen. What changes is only how many items carry
    them, so what a client reads is the same text, logprobs, finish and usage, in fewer
    events (the SSE writer would have written them in one write anyway). Not merged:
    another choice's output (the interleaving of choices stays), an output after a finish
    reason, an output whose text the engine decoded itself (the Backend gives a
    self-decoded output's text to its first token), one that reports ``cached_tokens``
    (an attempt's first), encode and prefill results, and outputs with logprobs next to
    outputs without. The outputs given are not modified.
    """
    if len(outputs) < 2:
        return outputs
    merged: list[EngineOutput] = []
    burst: EngineOutput | None = None  # the last merged output, when built here
    for output in outputs:
        last = merged[-1] if merged else None
        if last is None or not _extends(last, output):
            merged.append(output)
            continue
        if last is not burst:  # a copy to extend: the given outputs stay as they were
            logprobs, top = last.logprobs, last.top_logprobs
            burst = EngineOutput(
                list(last.token_ids),
                None if logprobs is None else list(logprobs),
                None if top is None else list(top),
                None,
                last.index,
                None,
                None,
                None,
                last.cached_tokens,
            )
            merged[-1] = burst
        burst.token_ids += output.token_ids
        if burst.logprobs is not None and output.logprobs is not None:
            burst.logprobs += output.logprobs
        if burst.top_logprobs is not None and output.top_logprobs is not None:
            burst.top_logprobs += output.top_logprobs
        burst.finish_reason = output.finish_reason
    return merged


def _extends(last: EngineOutput, output: EngineOutput) -> bool:
    """Whether ``output`` can join the burst ``last`` (see :func:`coalesce_outputs`)."""
    return (
        output.index == last.index
        and last.finish_reason is None
        and last.text is None
        and output.text is None
        and output.cached_tokens is None
        and last.encoder_result is None
        and last.prefill_result is None
        and output.encoder_result is None
        and output.prefill_result is None
        and (last.logprobs is None) is (output.logprobs is None)
        and (last.top_logprobs is None) is (output.top_logprobs is None)
    )


@final
class RequestLog:
    """Operator: count the requests in flight below it and log how each one ended.

    One info line per request, ``request ID finished|stopped|cancelled|failed (...)``, with
    the number still in flight; nothing is logged while it runs, and each output costs one
    generator hop. "cancelled" means the request was killed: its client closed the stream,
    disconnected, or its deadline passed.

    It also keeps the worker's load, for a planner (:meth:`load`): requests ``waiting`` for
    their first output (queued, or prefilling) with their prompt tokens, and those
    ``decoding``; ``on_change`` (cheap, synchronous) is called whenever those change.
    """

    __slots__ = (
        "_name",
        "decoding",
        "in_flight",
        "on_change",
        "prefill_tokens",
        "requests",
        "waiting",
    )

    def __init__(self, name: str = "worker") -> None:
        self._name = name
        #: requests being served now
        self.in_flight = 0
        #: requests accepted so far
        self.requests = 0
        #: requests without their first output yet, and their prompt tokens
        self.waiting = 0
        self.prefill_tokens = 0
        #: requests past their first output
        self.decoding = 0
        #: called whenever ``waiting``, ``prefill_tokens`` or ``decoding`` changed
        self.on_change: Callable[[], None] = _nothing

    def load(self) -> dict[str, int]:
        """The load now: ``{"waiting", "decoding", "prefill"}`` (the last in prompt tokens)."""
        return {"waiting": self.waiting, "decoding": self.decoding, "prefill": self.prefill_tokens}

    async def generate(self, ctx: Context[Any], downstream: Engine[Any, Any], /) -> Stream[Any]:
        """Pass ``ctx`` and its outputs through, counting and logging."""
        self.in_flight += 1
        self.requests += 1
        prompt = len(getattr(ctx.data, "token_ids", ()))
        self.waiting += 1
        self.prefill_tokens += prompt
        self.on_change()
        outputs = 0
        ended = "cancelled"
        try:
            async with aclosing(downstream.generate(ctx)) as stream:
                async for output in stream:
                    if not outputs:
                        self._first_output(prompt)
                    outputs += 1
                    yield output
            ended = "stopped" if ctx.is_stopped else "finished"
        except Exception as exc:
            ended = f"failed: {exc!r}"
            raise
        finally:
            self.in_flight -= 1
            if outputs:
                self.decoding -= 1
            else:
                self.waiting -= 1
                self.prefill_tokens -= prompt
            self.on_change()
            if ctx.is_killed:
                ended = "cancelled"
            logger.info(
                "%s: request %s %s after %d outputs (in flight: %d)",
                self._name,
                ctx.id,
                ended,
                outputs,
                self.in_flight,
            )

    def _first_output(self, prompt: int) -> None:
        self.waiting -= 1
        self.prefill_tokens -= prompt
        self.decoding += 1
        self.on_change()

    def __repr__(self) -> str:
        return f"RequestLog({self._name!r}, in_flight={self.in_flight})"


def _nothing() -> None:
    pass


_Workers = WorkerSet[PreprocessedRequest, EngineOutput]


class WorkerSets(NamedTuple):
    """The worker sets of one model, as the default graph takes them."""

    #: aggregated and decode workers: the graph's engine routes over these
    decode: _Workers
    #: prefill workers: the PrefillRouter's set (disaggregation is on while it has members)
    prefill: _Workers
    #: encode workers: the EncoderRouter's set
    encode: _Workers


#: which roles feed which worker set
_ROLE_SETS: Final = (
    ("aggregated", "decode"),
    ("decode", "decode"),
    ("prefill", "prefill"),
    ("encode", "encode"),
)


@asynccontextmanager
async def discover_workers(
    nc: Client, *, model: str, timeouts: NatsTimeouts | None = None
) -> AsyncGenerator[WorkerSets]:
    """Keep the :class:`WorkerSets` of ``model`` in step with its registered workers.

    Entering waits until every set holds the workers registered now; leaving stops
    following (the sets keep their last members). Workers join and leave while the block
    runs, and a worker whose registration expires (it died) is removed with its in-flight
    streams failed, so that Migration moves them.

    Raises:
        nats.errors.Error: the discovery bucket cannot be reached at first.
        RuntimeError: the NATS server has no JetStream.
    """
    sets = WorkerSets(
        decode=WorkerSet(f"{model} decode"),
        prefill=WorkerSet(f"{model} prefill"),
        encode=WorkerSet(f"{model} encode"),
    )
    async with anyio.create_task_group() as tg:
        for role, name in _ROLE_SETS:
            discovery: NatsDiscovery[PreprocessedRequest, EngineOutput] = NatsDiscovery(
                nc,
                model=model,
                role=role,
                codec=llm_codec(),
                timeouts=timeouts,
                coalesce=coalesce_outputs,
            )
            await tg.start(discovery.run, getattr(sets, name))
        try:
            yield sets
        finally:
            tg.cancel_scope.cancel()
