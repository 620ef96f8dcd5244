"""An engine made from a function that yields token ids: :func:`token_engine`.

The engine contract (docs/engines.md) asks every engine for the same bookkeeping: ``n``
choices, each ending with one ``finish_reason``; ``max_tokens``; the stop token ids;
continuing after ``replayed_tokens`` when Migration moved the request; an end at
``stop_generating()`` and at ``kill()``; a turn of the event loop per step. A function
wrapped by :func:`token_engine` does none of it. It is called once per choice with the
request and yields that choice's token ids, one at a time, for as long as it likes::

    @token_engine
    async def reply(request: PreprocessedRequest) -> AsyncIterator[int]:
        async for token_id in my_model.stream(request.token_ids, request.sampling):
            yield token_id

``reply`` is then an engine: ``build_app(reply, tokenizer, model_name="mine")``.

What the function gets is the request as a first attempt would have had it: ``token_ids``
is the prompt only (no replayed output), ``replayed_tokens`` is 0, ``n`` is 1 and
``stop.max_tokens`` the whole budget. It may read anything of it (``sampling``, ``lora``,
``tools``, ``priority``...) and may stop early (an end counts as ``"stop"``). It may be an
async iterable (an ``async def`` with ``yield``: wait for a model there) or a plain
iterable (a list, a generator), which runs on the event loop and so must be quick per
token. What the adapter does with what it yields:

* **n choices**: one call per choice, interleaved step by step (index 0..n-1).
* **max_tokens**: the token that reaches it ends its choice with ``"length"``.
* **stop token ids**: ``stop.stop_token_ids``, and ``stop.eos_token_ids`` unless
  ``ignore_eos``, end the choice with ``"stop"`` on that token (after ``min_tokens``).
* **replayed tokens**: after a migration the function runs from the prompt again and the
  first ``replayed_tokens`` it yields are dropped (the client has them), so a function
  that is deterministic for a request continues exactly; the replay costs those steps
  again. An engine that can continue from ``token_ids`` cheaply writes ``generate``
  itself (docs/engines.md).
* **stop and kill**: checked once per step; the functions' iterators are closed
  (``aclose``/``close``) however the stream ends.
* **refusals**: an empty prompt is an :class:`~pipeline.InvalidRequest` naming
  ``prompt``; a request for ``logprobs`` one naming ``logprobs`` (a function yields ids
  only). Constrained requests never get here: the graph refuses them for an engine that
  does not declare the feature.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeAlias, final

from anyio.lowlevel import checkpoint

from operators.contracts.llm import EngineOutput, FinishReason, PreprocessedRequest
from pipeline import InvalidRequest

if TYPE_CHECKING:
    from pipeline import Context, Stream

__all__ = ("TokenEngine", "TokenFunction", "token_engine")

TokenFunction: TypeAlias = Callable[[PreprocessedRequest], AsyncIterable[int] | Iterable[int]]
"""What :func:`token_engine` wraps: a request in, one choice's token ids out."""

_Tokens: TypeAlias = AsyncIterator[int] | Iterator[int]


@final
class TokenEngine:
    """An Engine[PreprocessedRequest, EngineOutput] around a :data:`TokenFunction`
    (what :func:`token_engine` returns; the module's docstring has the rules)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: TokenFunction, /) -> None:
        if not callable(fn):
            raise TypeError(f"token_engine() takes a function, not {fn!r}")
        self._fn = fn

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        """Stream the function's tokens for ``ctx``, one output per token per choice.

        Raises:
            InvalidRequest: an empty prompt, or a request for logprobs.
        """
        request = ctx.data
        if request.prompt_tokens <= 0:
            raise InvalidRequest("the prompt is empty", param="prompt", request_id=ctx.id)
        if request.output.logprobs is not None:
            raise InvalidRequest(
                f"{self!r} reports no logprobs", param="logprobs", request_id=ctx.id
            )
        stop = request.stop
        limit = stop.max_tokens
        min_tokens = stop.min_tokens
        stop_ids = frozenset(stop.stop_token_ids)
        if not stop.ignore_eos:
            stop_ids |= frozenset(stop.eos_token_ids)
        choices = max(request.n, 1)
        if limit == 0:
            for index in range(choices):
                yield EngineOutput([], finish_reason="length", index=index)
            return
        first = _first_attempt(request)
        async with contextlib.AsyncExitStack() as stack:
            sources = [_opened(self._fn(first), stack) for _ in range(choices)]
            # Counted from minus the replay: the function's first ids are what the client
            # has (it runs from the prompt again), dropped until the count turns positive.
            counts = [-request.replayed_tokens] * choices
            active = list(range(choices))
            while active:
                await checkpoint()  # a turn for the other requests, and a kill lands here
                if ctx.is_stopped:
                    return
                for index in tuple(active):
                    token_id = await _pull(sources[index])
                    if token_id is None:
                        active.remove(index)
                        yield EngineOutput([], finish_reason="stop", index=index)
                        continue
                    counts[index] = count = counts[index] + 1
                    if count <= 0:
                        continue
                    finish: FinishReason | None = None
                    if token_id in stop_ids and count > min_tokens:
                        finish = "stop"
                    elif limit is not None and count >= limit:
                        finish = "length"
                    if finish is not None:
                        active.remove(index)
                    yield EngineOutput([token_id], None, None, finish, index)

    def __repr__(self) -> str:
        return f"token_engine({getattr(self._fn, '__qualname__', self._fn)})"


def token_engine(fn: TokenFunction, /) -> TokenEngine:
    """The engine that answers each choice with the token ids ``fn(request)`` yields.

    Usable as a decorator. ``fn`` gets the request as a first attempt would (the prompt
    only, ``n`` 1, the whole ``max_tokens``) and yields ids from an async or a plain
    iterable; the engine handles ``n``, ``max_tokens``, stop ids, ``replayed_tokens``,
    stop and kill, and the finish reasons (this module's docstring).

    Raises:
        TypeError: ``fn`` is not callable.
    """
    return TokenEngine(fn)


def _first_attempt(request: PreprocessedRequest) -> PreprocessedRequest:
    """``request`` as the function sees it: as before any migration, one choice."""
    replayed = request.replayed_tokens
    if not replayed:
        return request if request.n == 1 else dataclasses.replace(request, n=1)
    stop = request.stop
    budget = stop.max_tokens
    return dataclasses.replace(
        request,
        token_ids=request.token_ids[: request.prompt_tokens],
        replayed_tokens=0,
        n=1,
        stop=dataclasses.replace(
            stop,
            max_tokens=None if budget is None else budget + replayed,
            # (Migration floors what is left at 0: a spent minimum stays spent)
            min_tokens=stop.min_tokens + replayed if stop.min_tokens else 0,
        ),
    )


def _opened(
    tokens: AsyncIterable[int] | Iterable[int], stack: contextlib.AsyncExitStack
) -> _Tokens:
    """An iterator over ``tokens``, closed when ``stack`` unwinds."""
    if isinstance(tokens, AsyncIterable):
        source: _Tokens = aiter(tokens)
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            stack.push_async_callback(aclose)
        return source
    source = iter(tokens)
    close = getattr(source, "close", None)
    if close is not None:
        stack.callback(close)
    return source


async def _pull(source: _Tokens) -> int | None:
    """The next token id of ``source``; None at its end."""
    if isinstance(source, AsyncIterator):
        return await anext(source, None)
    return next(source, None)
