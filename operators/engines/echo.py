"""The echo engine: streams the prompt's own token ids back, deterministically.

It is the CLI's default engine and the one tests and benchmarks use: no model, no GPU, and
every output is known in advance, so a test can compare a response with its prompt and a
benchmark measures the graph and the HTTP edge, not a model. What it emits for a request::

    prompt ids (specials skipped) --> one EngineOutput per id per choice
                                      (choices interleaved: index 0..n-1 at each step)
                                  --> finish_reason "stop" on the last id, or "length" when
                                      ``max_tokens`` runs out first

The prompt is what the preprocessor made of the request: for a chat, the whole conversation
as the chat template renders it (system prompt, role names, the tools preamble; role
markers are special ids and skipped). To answer with the last message alone, render with
:func:`operators.edges.openai.chat_template.last_message_template` (``serve --echo
last-message``): the engine sees token ids only, so what it echoes is chosen there.

Options make it useful beyond plain echo: a per-token delay (long streams for disconnect
tests), cycling (repeat the prompt until ``max_tokens``, for load tests), deterministic
logprobs, and an injected :class:`pipeline.StreamDisconnected` on the first attempt of every
request (for Migration's tests). A migration retry (``replayed_tokens > 0``) continues the
*original* prompt's echo where the first attempt stopped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import types
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar, Final, final

import anyio
from anyio.lowlevel import checkpoint

from operators.contracts.llm import EngineOutput, FinishReason, PreprocessedRequest, TopLogprobs
from pipeline import InvalidRequest, StreamDisconnected

if TYPE_CHECKING:
    from operators.text.tokenizer import Tokenizer
    from pipeline import Context, Stream

__all__ = ("DEFAULT_CYCLE_TOKENS", "TOKENS_PER_TURN", "EchoEngine", "echo_logprob")

logger = logging.getLogger(__name__)

#: how many tokens a cycling echo emits when the request sets no ``max_tokens``
DEFAULT_CYCLE_TOKENS: Final = 256
#: steps (a token for every choice) an unpaced echo emits per turn of the event loop. A turn
#: per token made every token a task switch, and at 256 streams each switch resumes a
#: request's generator chain that has left the CPU cache: two thirds of the server's CPU
#: per token went there (docs/design.md, "The hot path"). 16 steps hold the loop ~150 µs.
TOKENS_PER_TURN: Final = 16


@types.coroutine
def _asyncio_checkpoint() -> Generator[None, None, None]:
    """asyncio's ``sleep(0)`` without its coroutine: one bare yield, one loop turn."""
    yield


def _loop_turn() -> Callable[[], Awaitable[None]]:
    """The cheapest checkpoint for the running loop, looked up once per stream.

    anyio's ``checkpoint()`` finds the backend on every call (about a fifth of this
    engine's cost per token); on asyncio it is exactly one bare yield, which this is.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another event loop (trio)
        return checkpoint
    return _asyncio_checkpoint


def echo_logprob(token_id: int) -> float:
    """The logprob the echo engine reports for ``token_id`` (always < 0, deterministic)."""
    return -(token_id % 7) / 10 - 0.01


@final
class EchoEngine:
    """An Engine[PreprocessedRequest, EngineOutput] that echoes the prompt's token ids.

    Args:
        special_token_ids: ids never echoed (chat-template role markers, EOS), so that a
            chat prompt's markers do not end or pollute the echo.
        vocab_size: when given, alternative ids in ``top_logprobs`` wrap around below it.
        delay_ms: sleep this long before each step (one token for every choice); without
            a delay the engine gives the event loop a turn every ``tokens_per_turn`` steps.
        tokens_per_turn: steps between two turns of the loop when unpaced (1: a turn per
            token, as an engine that wakes every stream at every step; the server's cost
            per token at high concurrency is then the larger figure in docs/design.md).
        cycle: repeat the echo until ``max_tokens`` (or :data:`DEFAULT_CYCLE_TOKENS`).
        fail_after_tokens: on a request's first attempt (``replayed_tokens == 0``), raise
            :class:`pipeline.StreamDisconnected` after this many steps.
    """

    __slots__ = ("_cycle", "_delay", "_fail_after", "_per_turn", "_special", "_vocab_size")

    #: nothing beyond the base contract: a constrained request is refused, never echoed as
    #: if its constraint held (:func:`operators.contracts.llm.engine_features`)
    features: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        special_token_ids: Iterable[int] = (),
        *,
        vocab_size: int | None = None,
        delay_ms: float = 0.0,
        cycle: bool = False,
        fail_after_tokens: int | None = None,
        tokens_per_turn: int = TOKENS_PER_TURN,
    ) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        if tokens_per_turn < 1:
            raise ValueError(f"tokens_per_turn must be >= 1, got {tokens_per_turn}")
        self._per_turn = tokens_per_turn
        if fail_after_tokens is not None and fail_after_tokens < 0:
            raise ValueError(f"fail_after_tokens must be >= 0, got {fail_after_tokens}")
        self._special = frozenset(special_token_ids)
        self._vocab_size = vocab_size
        self._delay = delay_ms / 1000
        self._cycle = cycle
        self._fail_after = fail_after_tokens

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Tokenizer,
        *,
        delay_ms: float = 0.0,
        cycle: bool = False,
        fail_after_tokens: int | None = None,
        tokens_per_turn: int = TOKENS_PER_TURN,
    ) -> EchoEngine:
        """An echo engine that skips ``tokenizer``'s special and end-of-generation ids."""
        return cls(
            tokenizer.special_token_ids | tokenizer.eos_token_ids,
            vocab_size=tokenizer.vocab_size,
            delay_ms=delay_ms,
            cycle=cycle,
            fail_after_tokens=fail_after_tokens,
            tokens_per_turn=tokens_per_turn,
        )

    def _plan(self, request: PreprocessedRequest) -> tuple[Iterator[int], int, FinishReason]:
        """The ids this attempt emits, how many, and the finish reason on the last one."""
        token_ids = request.token_ids
        replayed = request.replayed_tokens
        prompt = token_ids[: len(token_ids) - replayed] if replayed else token_ids
        special = self._special
        # Filtered lazily, only as far as it is echoed: a prompt can be millions of ids.
        echo = (token_id for token_id in prompt if token_id not in special)
        # On a migration retry max_tokens is what is left of the original budget.
        budget = request.stop.max_tokens
        if self._cycle and budget is None:
            budget = max(DEFAULT_CYCLE_TOKENS - replayed, 0)
        end = None if budget is None else replayed + budget
        head = list(itertools.islice(echo, end))
        if end is not None and len(head) == end:
            return iter(head[replayed:]), end - replayed, "length"
        if self._cycle and head and end is not None:  # all of it, short of the budget: repeat
            return itertools.islice(itertools.cycle(head), replayed, end), end - replayed, "length"
        return iter(head[replayed:]), max(len(head) - replayed, 0), "stop"

    def _top_logprobs(self, token_id: int, logprob: float, k: int) -> TopLogprobs:
        """The sampled token first, then ``k`` deterministic less likely alternatives."""
        top: TopLogprobs = [(token_id, logprob)]
        vocab_size = self._vocab_size
        for rank in range(1, k + 1):
            other = token_id + rank
            if vocab_size:
                other %= vocab_size
            top.append((other, logprob - rank))
        return top

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        """Stream the echo for ``ctx``: one output per token per choice.

        Raises:
            InvalidRequest: the request has a constraint (``response_format``, a required
                tool call): an echo cannot honour one.
        """
        request = ctx.data
        if request.constraint is not None:
            raise InvalidRequest(
                f"{request.constraint.param!r} needs constrained decoding, which the echo "
                "engine does not support",
                param=request.constraint.param,
                request_id=ctx.id,
            )
        ids, count, finish_reason = self._plan(request)
        choices = range(max(request.n, 1))
        top_k = request.output.logprobs
        delay = self._delay
        turn, per_turn = _loop_turn(), self._per_turn
        fail_after = self._fail_after if request.replayed_tokens == 0 else None
        if count == 0:
            if fail_after == 0:
                raise StreamDisconnected(
                    "echo engine: injected disconnect before the first token", request_id=ctx.id
                )
            for index in choices:
                yield EngineOutput(token_ids=[], finish_reason=finish_reason, index=index)
            return
        last = count - 1
        for step, token_id in enumerate(ids):
            if step == fail_after:
                logger.debug("echo: injecting a disconnect into %s after %d tokens", ctx.id, step)
                raise StreamDisconnected(
                    f"echo engine: injected disconnect after {step} tokens", request_id=ctx.id
                )
            # Let the rest of the server run: before every step when paced, else once per
            # tokens_per_turn steps (a kill is still seen at every step, below).
            if delay:
                await anyio.sleep(delay)
            elif step % per_turn == 0:
                await turn()
            if ctx.is_stopped:
                return
            finish = finish_reason if step == last else None
            if top_k is None:
                for index in choices:  # (token_ids, logprobs, top_logprobs, finish, index)
                    yield EngineOutput([token_id], None, None, finish, index)
            else:
                logprob = echo_logprob(token_id)
                for index in choices:
                    yield EngineOutput(
                        token_ids=[token_id],
                        logprobs=[logprob],
                        top_logprobs=[self._top_logprobs(token_id, logprob, top_k)],
                        finish_reason=finish,
                        index=index,
                    )

    def __repr__(self) -> str:
        options = [f"specials={len(self._special)}"]
        if self._delay:
            options.append(f"delay_ms={self._delay * 1000:g}")
        if self._cycle:
            options.append("cycle=True")
        if self._fail_after is not None:
            options.append(f"fail_after_tokens={self._fail_after}")
        return f"EchoEngine({', '.join(options)})"
