"""The request-scoped :class:`Context`: payload, identity, typed state and cancellation.

One request is one *controller* (id, stop/kill flags, deadline, children) and one *state
store*. Operators change the payload's type as the request travels forward
(``ctx.replace(new_data)``) without changing the request: the new Context shares the
controller and the store. Fan-out legs (a migration attempt, a prefill leg, an encode leg)
are children (``ctx.child(data)``): stopping or killing the parent reaches them, never the
other way round, and they share the request's state store unless given their own.

Two ways to end a request early, as in Dynamo's ``AsyncEngineContext``:

* ``stop_generating()`` is graceful: engines stop producing and the stream ends cleanly.
* ``kill()`` is hard: the stream driver (:func:`pipeline.open_stream`) cancels the
  in-flight stream at once, wherever it is blocked.

A deadline, when it passes, behaves like ``kill()``.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, final, overload

import anyio

if TYPE_CHECKING:
    from anyio import CancelScope

    from .tracing import Span

__all__ = ("Context", "State", "StateKey", "StateKeyError")

T = TypeVar("T")
U = TypeVar("U")
T_co = TypeVar("T_co", covariant=True)

_key_numbers = itertools.count()


@final
class StateKey(Generic[T]):
    """A typed key into a request's :class:`State`.

    Keys compare by identity, so two modules that both name a key ``"decoder"`` can never
    collide: each owns its own ``StateKey`` object, created once at import time::

        DECODER = StateKey[DecoderState]("decoder")
        ctx.state.set(DECODER, DecoderState(...))
        state = ctx.state.get(DECODER)  # typed as DecoderState
    """

    __slots__ = ("_number", "name")

    def __init__(self, name: str) -> None:
        #: a label for reprs and error messages; not used for lookup
        self.name = name
        self._number = next(_key_numbers)

    def __repr__(self) -> str:
        return f"StateKey({self.name!r}#{self._number})"


class StateKeyError(LookupError):
    """A :class:`StateKey` was read from a :class:`State` that has no value for it."""


_MISSING: Any = object()


@final
class State:
    """A request-scoped store of values under :class:`StateKey` keys.

    Shared by every operator in the chain and by child contexts, so state written by an
    operator on one attempt of a request is found again on the next attempt.
    """

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[StateKey[Any], Any] = {}

    @overload
    def get(self, key: StateKey[T]) -> T: ...
    @overload
    def get(self, key: StateKey[T], default: U) -> T | U: ...
    def get(self, key: StateKey[T], default: Any = _MISSING) -> Any:
        """Return the value stored under ``key``.

        Raises:
            StateKeyError: when there is none and no ``default`` was given.
        """
        try:
            return self._values[key]
        except KeyError:
            if default is _MISSING:
                raise StateKeyError(f"no value for {key!r} in this request's state") from None
            return default

    def set(self, key: StateKey[T], value: T) -> None:
        """Store ``value`` under ``key``, replacing any earlier value."""
        self._values[key] = value

    def setdefault(self, key: StateKey[T], value: T) -> T:
        """Return the value under ``key``, storing ``value`` first if there is none."""
        return cast("T", self._values.setdefault(key, value))

    def pop(self, key: StateKey[T]) -> T:
        """Remove and return the value under ``key``.

        Raises:
            StateKeyError: when there is none.
        """
        try:
            return cast("T", self._values.pop(key))
        except KeyError:
            raise StateKeyError(f"no value for {key!r} in this request's state") from None

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __repr__(self) -> str:
        return f"State({sorted(k.name for k in self._values)})"


class _Controller:
    """The cancellation side of one request or one child leg (not public)."""

    __slots__ = (
        "_kill_event",
        "_scopes",
        "_stop_event",
        "children",
        "deadline",
        "failure",
        "killed",
        "parent",
        "stopped",
    )

    def __init__(self, deadline: float, parent: _Controller | None = None) -> None:
        self.stopped = False
        self.killed = False
        self.deadline = deadline
        self.parent = parent
        #: why the stream driven under this controller was failed (see :meth:`fail`)
        self.failure: BaseException | None = None
        self.children: list[_Controller] = []
        self._scopes: list[CancelScope] = []
        self._stop_event: anyio.Event | None = None
        self._kill_event: anyio.Event | None = None

    def stop(self) -> None:
        for child in self.children:
            child.stop()
        if not self.stopped:
            self.stopped = True
            if self._stop_event is not None:
                self._stop_event.set()

    def kill(self) -> None:
        # Cancel our own scopes before anything wakes up: a child's stop() would otherwise
        # wake an engine waiting on it first, and the stream would end gracefully instead
        # of being cancelled.
        if not self.killed:
            self.killed = True
            for scope in self._scopes:
                scope.cancel()
            if self._kill_event is not None:
                self._kill_event.set()
        for child in self.children:
            child.kill()
        self.stop()

    def fail(self, error: BaseException) -> None:
        # The nearest driver at or above this leg: its scope is what the stream waits under.
        driver: _Controller | None = self
        while driver is not None and not driver._scopes:
            driver = driver.parent
        if driver is None:  # nothing drives it (yet): a kill is all there is to do
            self.kill()
            return
        if driver.failure is None:
            driver.failure = error
        for scope in driver._scopes:
            scope.cancel()
        for child in driver.children:
            child.kill()

    def bind(self, scope: CancelScope) -> None:
        self._scopes.append(scope)
        if self.killed or self.failure is not None:
            scope.cancel()

    def unbind(self, scope: CancelScope) -> None:
        self._scopes.remove(scope)

    def spawn(self, deadline: float) -> _Controller:
        child = _Controller(min(deadline, self.deadline), self)
        self.children.append(child)
        if self.killed:
            child.kill()
        elif self.stopped:
            child.stop()
        return child

    async def wait_stopped(self) -> None:
        if not self.stopped:
            if self._stop_event is None:
                self._stop_event = anyio.Event()
            await self._stop_event.wait()

    async def wait_killed(self) -> None:
        if not self.killed:
            if self._kill_event is None:
                self._kill_event = anyio.Event()
            await self._kill_event.wait()


@final
class Context(Generic[T_co]):
    """One request (or one leg of it) as it travels through a graph.

    Create a root context with :meth:`Context.new` (or ``pipeline.testing.make_context`` in
    tests). Operators never mutate the payload in place; they pass ``ctx.replace(new)``
    downstream.
    """

    __slots__ = ("_controller", "_data", "_id", "_metadata", "_span", "_state")

    def __init__(
        self,
        data: T_co,
        *,
        id: str,  # noqa: A002 - the public name of the field
        metadata: Mapping[str, str],
        state: State,
        controller: _Controller,
        span: Span | None = None,
    ) -> None:
        self._data = data
        self._id = id
        self._metadata = metadata
        self._state = state
        self._controller = controller
        self._span = span

    @classmethod
    def new(
        cls,
        data: T,
        *,
        id: str | None = None,  # noqa: A002
        metadata: Mapping[str, str] | None = None,
        deadline: float | None = None,
        span: Span | None = None,
    ) -> Context[T]:
        """Start a new request.

        ``deadline`` is an absolute time on the event loop's clock (``anyio.current_time()``);
        when it passes the request is killed. ``span`` traces it (:mod:`pipeline.tracing`).
        """
        return Context(
            data,
            id=id if id is not None else uuid.uuid4().hex,
            metadata=dict(metadata or {}),
            state=State(),
            controller=_Controller(math.inf if deadline is None else deadline),
            span=span,
        )

    @property
    def data(self) -> T_co:
        """The payload: the request in the shape this stage of the graph speaks."""
        return self._data

    @property
    def id(self) -> str:
        """The request's id, the same for every replaced and child context of it."""
        return self._id

    @property
    def metadata(self) -> Mapping[str, str]:
        """Request annotations (headers, routing hints); children get a copy."""
        return self._metadata

    @property
    def state(self) -> State:
        """The request-scoped typed store (see :class:`StateKey`)."""
        return self._state

    @property
    def span(self) -> Span | None:
        """The span of the stage this context was given to, when the request is traced
        (:mod:`pipeline.tracing`); None otherwise. Replaced and child contexts keep it."""
        return self._span

    @property
    def deadline(self) -> float | None:
        """Absolute loop time after which the request is killed, or None."""
        deadline = self._controller.deadline
        return None if deadline == math.inf else deadline

    @property
    def is_stopped(self) -> bool:
        """True once ``stop_generating()`` or ``kill()`` reached this context."""
        return self._controller.stopped

    @property
    def is_killed(self) -> bool:
        """True once ``kill()`` reached this context (directly, from a parent, or a deadline)."""
        return self._controller.killed

    def replace(self, data: U) -> Context[U]:
        """The same request with a new payload: shares id, state and cancellation."""
        return Context(
            data,
            id=self._id,
            metadata=self._metadata,
            state=self._state,
            controller=self._controller,
            span=self._span,
        )

    def with_span(self, span: Span | None) -> Context[T_co]:
        """The same request (payload, id, state, cancellation) traced under ``span``: what
        a stage passes on so that the spans of what it calls hang under its own."""
        return Context(
            self._data,
            id=self._id,
            metadata=self._metadata,
            state=self._state,
            controller=self._controller,
            span=span,
        )

    def child(
        self,
        data: U,
        *,
        state: State | None = None,
        metadata: Mapping[str, str] | None = None,
        deadline: float | None = None,
    ) -> Context[U]:
        """A linked leg of this request (a retry, a prefill or encode leg).

        The parent's stop and kill reach the child, also when they happened before the
        child was made; the child's own stop and kill never reach the parent. The child
        shares the request's state store unless ``state`` gives it its own (for fan-out
        into independent sub-requests whose decoders must not collide).
        """
        return Context(
            data,
            id=self._id,
            metadata=dict(self._metadata if metadata is None else metadata),
            state=self._state if state is None else state,
            controller=self._controller.spawn(math.inf if deadline is None else deadline),
            span=self._span,
        )

    def stop_generating(self) -> None:
        """Ask the engine to stop producing; the stream then ends cleanly. Idempotent."""
        self._controller.stop()

    def kill(self) -> None:
        """Cancel the in-flight stream now, and every child's. Idempotent."""
        self._controller.kill()

    def fail(self, error: BaseException) -> None:
        """End the stream now with ``error``, from any task (a watchdog's).

        A kill says "nobody wants the rest"; a failure says "the rest will not come, and
        here is why". The nearest driver at or above this leg (the :func:`~pipeline.
        open_stream` whose scope the stream runs under: the edge's, a worker's) is
        cancelled, its legs killed, and it raises ``error`` instead of exiting quietly,
        so the request fails with a reason (an engine that stalled under it,
        :class:`~pipeline.EngineStalled`) rather than looking cancelled by its client.
        Interrupting a stream that waits inside an engine needs a cancel scope around
        the wait, and operators hold none across a ``yield`` (the driver does), hence the
        driver. The driver's own context is neither stopped nor killed by it. With no
        driver above, this is a kill. Only the first failure of a driver counts.
        """
        self._controller.fail(error)

    async def wait_stopped(self) -> None:
        """Wait until this context is stopped (or killed)."""
        await self._controller.wait_stopped()

    async def wait_killed(self) -> None:
        """Wait until this context is killed."""
        await self._controller.wait_killed()

    def _bind_scope(self, scope: CancelScope) -> None:
        self._controller.bind(scope)

    def _unbind_scope(self, scope: CancelScope) -> None:
        self._controller.unbind(scope)

    def _failure(self) -> BaseException | None:
        return self._controller.failure

    def __repr__(self) -> str:
        flags = "killed" if self.is_killed else "stopped" if self.is_stopped else "live"
        return f"<Context id={self._id!r} {flags} data={type(self._data).__name__}>"
