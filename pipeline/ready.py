"""Awaiting a stream's next item, and learning on the way whether it was ready.

A writer that coalesces *writes* (the SSE writer, a remote worker's frame sender) sends
the items that are already available in one write (several choices of one step, a
speculative burst, frames that piled up from a remote worker) and writes what it holds the
moment the producer would wait. Telling "ready" from "would wait" needs no queue, task or
timer: :func:`next_or_wait` starts the stream's ``__anext__`` by hand, and only if the
producer suspends *waiting for something* does it run ``on_wait()`` (the flush) before
handing the suspension to the event loop, exactly as ``await`` would have::

    item ready at once             -> returned; nothing written yet
    producer yields the loop a turn -> still ready: the turn is taken, nothing written
    producer waits (a future)      -> on_wait() runs (writes the buffer), then the wait

A bare yield (asyncio's ``sleep(0)``, which anyio's ``checkpoint()`` is) is how a fair
producer lets other tasks run between items without waiting for anything: the item after
it is as ready as one produced without it, so it does not count as a wait. On an event
loop whose checkpoints are not bare yields (trio), every suspension counts as a wait,
which is merely less coalescing. The writer bounds how long it holds ready items.

This is ``yield from`` written out, so the event loop, cancellation and the producer see
what they would see with a plain ``await stream.__anext__()``. If ``on_wait`` fails or is
cancelled, the exception is thrown into the suspended producer first, so the generator
chain unwinds at its own await point (as it would under a cancelled plain ``await``) and
is never left half-run; then the exception propagates.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

__all__ = ("next_or_wait",)

T = TypeVar("T")


@types.coroutine
def _next_or_wait(
    next_: Awaitable[Any], on_wait: Callable[[], Awaitable[None]]
) -> Generator[Any, Any, Any]:
    # A generator function, not an awaitable class: one object per item instead of two.
    inner = next_.__await__()
    try:
        suspended = inner.send(None)
    except StopIteration as done:
        return done.value  # ready: no suspension at all
    while suspended is None:
        # A bare yield (asyncio's ``sleep(0)``, anyio's ``checkpoint()``): the producer
        # gives the loop a turn for fairness but waits for nothing; it is still ready.
        try:
            sent = yield None
        except GeneratorExit:
            inner.close()
            raise
        except BaseException as exc:  # cancellation at the producer's checkpoint
            try:
                suspended = inner.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        try:
            suspended = inner.send(sent)
        except StopIteration as done:
            return done.value
    try:
        yield from on_wait().__await__()
    except BaseException as exc:
        yield from _unwind(inner, exc)
        raise
    return (yield from _delegate(inner, suspended))


def _delegate(inner: Generator[Any, Any, Any], suspended: Any) -> Generator[Any, Any, Any]:
    """Go on with ``inner``, already suspended on ``suspended``: ``yield from`` by hand."""
    while True:
        try:
            sent = yield suspended
        except GeneratorExit:
            inner.close()
            raise
        except BaseException as exc:  # cancellation and the like, for the producer to see
            try:
                suspended = inner.throw(exc)
            except StopIteration as done:
                return done.value
        else:
            try:
                suspended = inner.send(sent)
            except StopIteration as done:
                return done.value


def _unwind(inner: Generator[Any, Any, Any], exc: BaseException) -> Generator[Any, Any, None]:
    """Throw ``exc`` into the suspended ``inner`` and let it finish unwinding."""
    try:
        suspended = inner.throw(exc)
    except BaseException:  # it raised (usually exc itself) or returned: it is done
        return
    try:
        yield from _delegate(inner, suspended)
    except BaseException:  # the caller raises ``exc``; this one is the producer's echo of it
        return


def next_or_wait(next_: Awaitable[T], on_wait: Callable[[], Awaitable[None]]) -> Awaitable[T]:
    """Await ``next_`` (a stream's ``__anext__()``), running ``on_wait()`` first if it would
    suspend. StopAsyncIteration and the producer's errors propagate unchanged."""
    return _next_or_wait(next_, on_wait)
