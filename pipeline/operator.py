"""The two nouns of the framework: :class:`Engine` and :class:`Operator`.

An *engine* turns one request into a stream of outputs. An *operator* is a stage in front
of an engine: it sees the request on its way forward and every output on its way back::

    ... --> Context[In] ------> [Operator] --> Context[DownIn] ------> [downstream Engine]
    ... <-- Stream[Out]         [Operator] <-- Stream[DownOut]      <--

All three are Protocols: write a plain class whose ``generate`` is an async generator
annotated ``-> Stream[Out]``; no base class, no decorator, no registration.
:func:`pipeline.link` folds operators onto an engine and the result is again an Engine, so
graphs nest.

A :class:`Stream` is what every ``generate`` returns: an async iterator that can be closed
(``aclose``), the way httpx's ``AsyncByteStream`` is. Closing is part of the contract
because a consumer that stops early must be able to end the producer's generator, and its
downstream's, in its own task (``async with aclosing(downstream.generate(ctx))``); a bare
``AsyncIterator`` promises no ``aclose``. An async generator function is a Stream as it is.

An operator with nothing to do for some request may hand downstream's stream straight
back: write ``generate`` as a plain method that returns ``downstream.generate(ctx)`` for
those requests and its own async generator for the others. ``link`` then adds nothing per
item for them (a passthrough router costs no hop per token).

Operators run in the consumer's task: stage N's generator is iterated directly by stage
N-1, so exceptions, cancellation and context variables flow through unchanged. Never hold a
task group or cancel scope open across a ``yield``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable

    from .context import Context

__all__ = ("Engine", "Operator", "Stream")

T_co = TypeVar("T_co", covariant=True)
In_contra = TypeVar("In_contra", contravariant=True)
Out_co = TypeVar("Out_co", covariant=True)
DownIn_co = TypeVar("DownIn_co", covariant=True)
DownOut_contra = TypeVar("DownOut_contra", contravariant=True)


class Stream(Protocol[T_co]):
    """An async iterator of ``T_co`` that can be closed early: what ``generate`` returns.

    Every async generator is one (``async def generate(...) -> Stream[T]: ... yield``), and
    so is :func:`pipeline.link`'s result. It is a Protocol, not ``AsyncGenerator``, so a
    hand-written stream class qualifies without ``asend``/``athrow``, and every Stream is
    accepted where an ``AsyncIterator`` is expected. ``__aiter__`` is declared to return an
    ``AsyncIterator`` (not ``Stream``) because that is what typeshed says an async
    generator's ``__aiter__`` returns.
    """

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    async def aclose(self) -> None:
        """End the stream now, releasing what it holds (it may still be running)."""
        ...


class Engine(Protocol[In_contra, Out_co]):
    """Anything that streams outputs for a request."""

    def generate(self, ctx: Context[In_contra], /) -> Stream[Out_co]:
        """Start the stream for ``ctx``; usually written as an async generator."""
        ...


class Operator(Protocol[In_contra, Out_co, DownIn_co, DownOut_contra]):
    """A stage between a caller and a downstream engine.

    What ``generate`` does before and while calling ``downstream.generate(...)`` is its
    forward edge; what it does to each item it yields is its backward edge.
    """

    def generate(
        self,
        ctx: Context[In_contra],
        downstream: Engine[DownIn_co, DownOut_contra],
        /,
    ) -> Stream[Out_co]:
        """Serve ``ctx`` using ``downstream``; usually written as an async generator."""
        ...
