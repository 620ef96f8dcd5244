"""The mocker engine: a simulated worker with a model's timing and every worker role.

It stands in for a real engine in load tests and in disaggregated graphs, where what
matters is *when* tokens arrive and *which* worker did what, not what the tokens mean. One
:class:`MockerEngine` is one worker (one simulated accelerator)::

    request --> wait for a batch slot (max_batch sequences at most)
            --> join the next engine step: prefill cost per prompt token
            --> one token per step (all active sequences share one step clock)
            --> finish "length" at max_tokens (16 when the request sets none)

Roles, as in Dynamo's disaggregated serving:

- ``aggregated``: prefill and decode on this worker.
- ``prefill``: one token, plus an opaque transfer handle in ``EngineOutput.prefill_result``
  (standing in for the KV cache a decode worker would pull), signed with HMAC.
- ``decode``: a request carrying ``prefill_result`` must carry a handle a prefill worker
  issued for this request, or the engine raises :class:`pipeline.EngineError`; with a valid
  handle it skips the prefill and emits tokens 2..max_tokens (token 1 came from prefill).
  Without ``prefill_result`` it serves the request aggregated.
- ``encode``: an object-shaped ``encoder_result`` for the request's multimodal items on a
  terminal output with no token ids.

Tokens are a pure function of the prompt and the position, so a sequence split across
workers (prefill here, decode there, a migration retry elsewhere) equals the one an
aggregated worker emits.

The step clock (:class:`~operators.engines._step_clock.StepClock`) has no task of its own:
every sequence sleeps until the end of the step it waits for, and whichever sequence wakes
first launches the next step. A step lasts ``decode_ms_per_step`` plus
``prefill_ms_per_token`` for every prompt token admitted into it, so a new request's
prefill stalls the sequences already decoding on the same worker: the interference that
disaggregation removes; plus ``decode_ms_per_sequence`` for every sequence in the batch
(0 by default), so that a worker's inter-token latency grows with its load. Transfer
handles are :mod:`operators.engines._transfer_handle`.

With ``cache_blocks`` the worker keeps a prefix cache (:mod:`operators.engines._prefix_cache`):
a prompt's leading cached blocks cost no prefill, and the cache reports what it holds as KV
events, so a KV-aware router (issue 16) has something real to win.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, NamedTuple, final

import anyio

from operators.contracts.llm import EngineOutput, FinishReason, PreprocessedRequest
from pipeline import EngineError, InvalidRequest, KvSnapshot, StreamDisconnected, WorkerLoad

from ._load_meter import LoadMeter
from ._mock_tokens import TokenSource, embeddings, top_logprobs
from ._prefix_cache import DEFAULT_BLOCK_SIZE, KvEventSink, PrefixCache
from ._step_clock import StepClock
from ._transfer_handle import PROCESS_SECRET, handle_problem, issue_handle
from .echo import echo_logprob

if TYPE_CHECKING:
    from operators.text.tokenizer import Tokenizer
    from pipeline import Context, Stream

__all__ = ("DEFAULT_MAX_TOKENS", "IMAGE_TOKENS", "MockerEngine", "MockerStatistics", "Role")

logger = logging.getLogger(__name__)

Role = Literal["aggregated", "prefill", "decode", "encode"]
"""What a worker does for a request (see the module docstring)."""

#: tokens a request generates when it sets no ``max_tokens``
DEFAULT_MAX_TOKENS: Final = 16
#: prompt tokens one image costs to encode (on an encode worker, or inline)
IMAGE_TOKENS: Final = 64


class MockerStatistics(NamedTuple):
    """A snapshot of a :class:`MockerEngine`, from :meth:`MockerEngine.statistics`."""

    steps: int  #: engine steps run so far
    active: int  #: sequences holding a batch slot
    waiting: int  #: requests waiting for a batch slot
    prefill_tokens: int = 0  #: prompt tokens prefilled, not found in the prefix cache
    cached_prompt_tokens: int = 0  #: prompt tokens found in the prefix cache


class _Plan(NamedTuple):
    """What one attempt emits: ``length`` tokens from position ``start`` of the sequence."""

    start: int
    length: int
    prefill_tokens: int


@final
class MockerEngine:
    """An Engine[PreprocessedRequest, EngineOutput] that simulates one worker's timing.

    Args:
        role: what this worker does (see the module docstring).
        prefill_ms_per_token: simulated prefill cost per prompt token.
        decode_ms_per_step: simulated duration of one engine step (one token for every
            active sequence).
        decode_ms_per_sequence: what each sequence in the batch adds to a step.
        max_batch: most sequences in flight; further requests wait for a slot.
        tokens: ``"echo"`` cycles the prompt's ids (minus ``special_ids``); ``"random"``
            draws seeded pseudo-random ids, a function of ``seed`` and the prompt.
        seed: the seed of ``"random"`` tokens; workers of one deployment share it.
        fail_after_tokens: on a request's first attempt (``replayed_tokens == 0``), raise
            :class:`pipeline.StreamDisconnected` after emitting this many tokens.
        freeze_after_tokens: once it emitted this many tokens in all, the engine freezes as
            one stopped with SIGSTOP would: every stream waits forever for its next token
            (fault injection for :mod:`pipeline.health`'s stall watchdog).
        worker_id: this worker's name in transfer handles and encoder results.
        special_ids: ids never echoed (chat-template markers, EOS).
        transfer_secret: the HMAC key of transfer handles; prefill and decode workers
            must share it. Defaults to a secret shared by every mocker in this process.
        block_size: tokens per prefix-cache block (the KV router's block size).
        cache_blocks: prefix-cache capacity in blocks, LRU-evicted (a prompt's leading
            cached blocks skip prefill); 0, the default: no cache, every prompt is
            prefilled in full (``_prefix_cache.DEFAULT_CACHE_BLOCKS`` is a typical size).
        kv_events: receives the cache's KV events (``pipeline.prefix_index``); see
            :attr:`kv_events` and :meth:`kv_snapshot`.
    """

    __slots__ = (
        "_cache",
        "_clock",
        "_decode_s",
        "_emitted",
        "_fail_after",
        "_freeze_after",
        "_max_batch",
        "_meter",
        "_prefill_s",
        "_secret",
        "_slots",
        "_source",
        "_waiting",
        "role",
        "worker_id",
    )

    #: nothing beyond the base contract: its tokens are a function of the prompt, so a
    #: constrained request is refused (:func:`operators.contracts.llm.engine_features`)
    features: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        *,
        role: Role = "aggregated",
        prefill_ms_per_token: float = 0.05,
        decode_ms_per_step: float = 5.0,
        decode_ms_per_sequence: float = 0.0,
        max_batch: int = 64,
        tokens: Literal["echo", "random"] = "echo",
        seed: int = 0,
        fail_after_tokens: int | None = None,
        freeze_after_tokens: int | None = None,
        worker_id: str = "mocker",
        special_ids: Iterable[int] = (),
        transfer_secret: bytes | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_blocks: int = 0,
        kv_events: KvEventSink | None = None,
    ) -> None:
        if role not in ("aggregated", "prefill", "decode", "encode"):
            raise ValueError(f"unknown mocker role {role!r}")
        if tokens not in ("echo", "random"):
            raise ValueError(f"tokens must be 'echo' or 'random', got {tokens!r}")
        if prefill_ms_per_token < 0 or decode_ms_per_step < 0 or decode_ms_per_sequence < 0:
            raise ValueError(
                "prefill_ms_per_token, decode_ms_per_step and decode_ms_per_sequence must be >= 0"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if fail_after_tokens is not None and fail_after_tokens < 0:
            raise ValueError(f"fail_after_tokens must be >= 0, got {fail_after_tokens}")
        if cache_blocks < 0:
            raise ValueError(f"cache_blocks must be >= 0, got {cache_blocks}")
        #: this worker's role
        self.role: Role = role
        #: this worker's name in handles and encoder results
        self.worker_id = worker_id
        self._prefill_s = prefill_ms_per_token / 1000
        self._decode_s = decode_ms_per_step / 1000
        self._max_batch = max_batch
        self._source = TokenSource(tokens, seed, special_ids)
        self._fail_after = fail_after_tokens
        self._freeze_after = freeze_after_tokens
        self._emitted = 0  # tokens emitted in all
        self._secret = PROCESS_SECRET if transfer_secret is None else transfer_secret
        self._clock = StepClock(self._decode_s, self._prefill_s, decode_ms_per_sequence / 1000)
        self._slots = anyio.Semaphore(max_batch)
        self._waiting = 0
        self._cache = PrefixCache(block_size, cache_blocks, kv_events) if cache_blocks else None
        self._meter = LoadMeter()

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, **options: Any) -> MockerEngine:
        """A mocker that never echoes ``tokenizer``'s special and end-of-generation ids."""
        return cls(special_ids=tokenizer.special_token_ids | tokenizer.eos_token_ids, **options)

    def statistics(self) -> MockerStatistics:
        """Steps run, sequences in flight, requests waiting for a batch slot."""
        cache = self._cache
        return MockerStatistics(
            steps=self._clock.step,
            active=self._max_batch - self._slots.value,
            waiting=self._waiting,
            prefill_tokens=0 if cache is None else cache.computed_tokens,
            cached_prompt_tokens=0 if cache is None else cache.cached_tokens,
        )

    def load_report(self) -> WorkerLoad:
        """Its load now, for the KV router: prompt tokens queued for prefill (a queued
        prompt's cached blocks looked up on arrival), sequences decoding and before their
        first token."""
        return self._meter.report()

    @property
    def kv_events(self) -> KvEventSink | None:
        """Where the prefix cache reports blocks stored, removed and cleared (None: nowhere).

        A sink set after requests were served should start from :meth:`kv_snapshot`.
        """
        return None if self._cache is None else self._cache.sink

    @kv_events.setter
    def kv_events(self, sink: KvEventSink | None) -> None:
        if self._cache is not None:
            self._cache.sink = sink

    def kv_snapshot(self) -> KvSnapshot:
        """Every block the prefix cache holds, as of its last event (empty: no cache)."""
        return KvSnapshot(()) if self._cache is None else self._cache.snapshot()

    # ------------------------------------------------------------------------- tokens

    def token_at(self, request: PreprocessedRequest, position: int) -> int:
        """The token this mocker generates at ``position`` (0: the first output token)."""
        return self._source.at(request, position)

    # ------------------------------------------------------------------ transfer handles

    def _issue_handle(self, ctx: Context[PreprocessedRequest], first_token: int) -> dict[str, Any]:
        return issue_handle(self._secret, self.worker_id, ctx, first_token)

    def _check_handle(self, ctx: Context[PreprocessedRequest]) -> None:
        """Raise EngineError unless ``prefill_result`` is a handle issued for this request."""
        request = ctx.data
        first_token = self.token_at(request, request.replayed_tokens)
        problem = handle_problem(self._secret, ctx, first_token)
        if problem is not None:
            raise EngineError(
                f"mocker {self.worker_id!r}: invalid or missing transfer handle in "
                f"prefill_result: {problem}; a decode request must carry the prefill_result "
                "a prefill worker returned for it",
                request_id=ctx.id,
            )

    # -------------------------------------------------------------------- multimodal

    def _image_tokens(self, ctx: Context[PreprocessedRequest]) -> int:
        """Prompt tokens the request's images cost here: none when already encoded.

        An ``encoder_result`` is opaque, except that one with ``embeddings`` (as a mocker
        encode worker returns) must describe this request's images.
        """
        request = ctx.data
        if not request.multimodal:
            return 0
        result = request.encoder_result
        if result is None:
            return IMAGE_TOKENS * len(request.multimodal)  # inline encoding
        if "embeddings" in result and result["embeddings"] != embeddings(request):
            raise EngineError(
                f"mocker {self.worker_id!r}: encoder_result does not describe this request's "
                "multimodal items",
                request_id=ctx.id,
            )
        return 0

    # ------------------------------------------------------------------------ serving

    def _plan(self, ctx: Context[PreprocessedRequest]) -> _Plan:
        request = ctx.data
        replayed = request.replayed_tokens
        budget = request.stop.max_tokens
        if budget is None:
            budget = max(DEFAULT_MAX_TOKENS - replayed, 0)
        role = self.role
        if role == "encode":
            return _Plan(0, 0, IMAGE_TOKENS * len(request.multimodal))
        if role == "prefill":
            return _Plan(replayed, 1, len(request.token_ids) + self._image_tokens(ctx))
        if request.prefill_result is not None:
            self._check_handle(ctx)
            if ctx.span is not None:
                ctx.span.add_event("kv_transfer", {"llm_pipeline.worker.id": self.worker_id})
            # The first token came from the prefill worker: continue after it.
            return _Plan(replayed + 1, max(budget - 1, 0), 0)
        return _Plan(replayed, budget, len(request.token_ids) + self._image_tokens(ctx))

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        """Serve ``ctx`` in this worker's role, on the worker's step clock.

        Raises:
            InvalidRequest: the request has a constraint and this worker would generate
                tokens (every role but ``encode``, whose output has none).
            EngineError: a decode request with an invalid transfer handle, or an
                ``encoder_result`` that does not match the request's images.
            StreamDisconnected: injected by ``fail_after_tokens``.
        """
        request = ctx.data
        if request.constraint is not None and self.role != "encode":
            raise InvalidRequest(
                f"{request.constraint.param!r} needs constrained decoding, which the mocker "
                "engine does not support",
                param=request.constraint.param,
                request_id=ctx.id,
            )
        plan = self._plan(ctx)
        if plan.length == 0 and self.role != "encode":
            for index in range(max(request.n, 1)):
                yield EngineOutput(token_ids=[], finish_reason="length", index=index)
            return
        fail_after = self._fail_after if request.replayed_tokens == 0 else None
        if fail_after == 0:
            raise StreamDisconnected(
                f"mocker {self.worker_id!r}: injected disconnect before the first token",
                request_id=ctx.id,
            )
        cache = self._cache if plan.prefill_tokens and self.role != "encode" else None
        blocks = cache.block_ids(request.token_ids, request.lora) if cache is not None else []
        estimate = plan.prefill_tokens
        if cache is not None:
            estimate -= min(cache.held(blocks) * cache.block_size, len(request.token_ids))
        metered = self._meter.arrived(estimate)
        self._waiting += 1
        try:
            await self._slots.acquire()
        except BaseException:
            metered.close()
            raise
        finally:
            self._waiting -= 1
        span = ctx.span
        if span is not None:  # a traced request: queue wait, prefill and decode as events
            span.add_event("scheduled")
        hit: int | None = None  # reported on the first output when there is a cache
        if cache is not None:  # leading cached blocks skip prefill (not the images)
            hit = cache.lookup(blocks, len(request.token_ids))
            plan = plan._replace(prefill_tokens=plan.prefill_tokens - hit)
            metered.adjust(plan.prefill_tokens)
        clock = self._clock
        first, last = clock.join(anyio.current_time(), plan.prefill_tokens, max(plan.length, 1))
        try:
            if self.role == "encode":
                await clock.wait_step(first)
                if not ctx.is_stopped:
                    yield EngineOutput(
                        token_ids=[],
                        finish_reason="stop",
                        encoder_result={
                            "embeddings": embeddings(request),
                            "worker_id": self.worker_id,
                        },
                    )
                return
            choices = range(max(request.n, 1))
            top_k = request.output.logprobs
            final = plan.length - 1
            sequence = self._source.sequence(request, plan.start)
            for emitted in range(plan.length):
                if emitted == fail_after:
                    logger.debug("mocker: injecting a disconnect into %s", ctx.id)
                    raise StreamDisconnected(
                        f"mocker {self.worker_id!r}: injected disconnect after {emitted} tokens",
                        request_id=ctx.id,
                    )
                if self._freeze_after is not None and self._emitted >= self._freeze_after:
                    await anyio.sleep_forever()  # frozen (a kill still ends the wait)
                await clock.wait_step(first + emitted)
                if ctx.is_stopped:
                    return
                self._emitted += 1
                if emitted == 0:
                    metered.prefilled()
                    if cache is not None:
                        cache.store(blocks)  # prefilled: the prompt's blocks are now cached
                    if span is not None:
                        span.add_event(
                            "prefilled",
                            {
                                "llm_pipeline.prefill_tokens": plan.prefill_tokens,
                                "llm_pipeline.cached_tokens": hit or 0,
                            },
                        )
                token_id = next(sequence)
                finish: FinishReason | None = "length" if emitted == final else None
                handle = None
                if self.role == "prefill":
                    handle = self._issue_handle(ctx, token_id)
                logprobs = None
                top = None
                if top_k is not None:
                    logprob = echo_logprob(token_id)
                    logprobs = [logprob]
                    top = [top_logprobs(token_id, logprob, top_k)]
                for index in choices:
                    yield EngineOutput(
                        token_ids=[token_id],
                        logprobs=logprobs,
                        top_logprobs=top,
                        finish_reason=finish,
                        index=index,
                        prefill_result=handle,
                        cached_tokens=hit if emitted == 0 else None,
                    )
        finally:
            clock.leave(anyio.current_time(), first, last, plan.prefill_tokens)
            self._slots.release()
            metered.close()

    def __repr__(self) -> str:
        options = [
            f"role={self.role!r}",
            f"worker_id={self.worker_id!r}",
            f"prefill_ms_per_token={self._prefill_s * 1000:g}",
            f"decode_ms_per_step={self._decode_s * 1000:g}",
            f"max_batch={self._max_batch}",
            f"tokens={self._source.kind!r}",
        ]
        if self._fail_after is not None:
            options.append(f"fail_after_tokens={self._fail_after}")
        return f"MockerEngine({', '.join(options)})"
