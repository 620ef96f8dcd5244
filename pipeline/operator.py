"""The two nouns of the framework: :class:`Engine` and :class:`Operator`.

An *engine* turns one request into a stream of outputs. An *operator* is a stage in front
of an engine: it sees the request on its way forward and every output on its way back::

    ... --> Context[In] -----> [Operator] --> Context[DownIn] ----> [downstream Engine]
    ... <-- AsyncIterator[Out] [Operator] <-- AsyncIterator[DownOut] <--

Both are Protocols: write a plain class whose ``generate`` is an async generator; no base
class, no decorator, no registration. :func:`pipeline.link` folds operators onto an engine
and the result is again an Engine, so graphs nest.

An operator with nothing to do for some request may hand downstream's stream straight
back: write ``generate`` as a plain method that returns ``downstream.generate(ctx)`` for
those requests and its own async generator for the others. ``link`` then adds nothing per
item for them (a passthrough router costs no hop per token).

Operators run in the consumer's task: stage N's generator is iterated directly by stage
N-1, so exceptions, cancellation and context variables flow through unchanged. Never hold a
task group or cancel scope open across a ``yield``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from .context import Context

__all__ = ("Engine", "Operator")

In_contra = TypeVar("In_contra", contravariant=True)
Out_co = TypeVar("Out_co", covariant=True)
DownIn_co = TypeVar("DownIn_co", covariant=True)
DownOut_contra = TypeVar("DownOut_contra", contravariant=True)


class Engine(Protocol[In_contra, Out_co]):
    """Anything that streams outputs for a request."""

    def generate(self, ctx: Context[In_contra], /) -> AsyncIterator[Out_co]:
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
    ) -> AsyncIterator[Out_co]:
        """Serve ``ctx`` using ``downstream``; usually written as an async generator."""
        ...
