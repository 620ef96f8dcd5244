"""Routers: Engines that pick a downstream worker per request from a :class:`WorkerSet`.

A :class:`WorkerSet` is the live membership of one pool of workers (say, the decode workers
of a model). A discovery source keeps it current: :class:`MemoryDiscovery` in one process,
a network source when workers live elsewhere. Membership may change while requests are in
flight; a request keeps the worker it was given, new requests see the new set.

A :class:`Router` wraps a WorkerSet and a policy (:class:`RoundRobin`, :class:`Random`,
:class:`LeastLoaded`, :class:`Direct`) and is itself an Engine, so it links like any other.

Requests waiting for a member are let through in :mod:`pipeline.priority` order when the
membership changes: by their payload's ``priority`` (lower first), then arrival, with aging.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, Protocol, TypeVar, final

import anyio

from .errors import CapacityExhausted
from .priority import PriorityQueue, admission_key, priority_of
from .worker_load import PREDICTED_PREFILL, LoadLedger

if TYPE_CHECKING:
    from .context import Context
    from .operator import Engine, Stream

__all__ = (
    "Direct",
    "LeastLoaded",
    "MembershipListener",
    "MemoryDiscovery",
    "Random",
    "RoundRobin",
    "Router",
    "RoutingPolicy",
    "Worker",
    "WorkerSet",
    "WorkerSetStatistics",
)

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")

#: ``listener(worker_id, joined)``: a worker joined (True) or left (False) a WorkerSet
MembershipListener = Callable[[str, bool], None]


@final
class Worker(Generic[In, Out]):
    """One member of a WorkerSet: an id, its engine, its in-flight request count, and the
    ledger of what routers sent it (:class:`~pipeline.worker_load.LoadLedger`)."""

    __slots__ = ("engine", "id", "in_flight", "ledger")

    def __init__(self, worker_id: str, engine: Engine[In, Out]) -> None:
        self.id = worker_id
        self.engine = engine
        #: requests currently streaming from this worker
        self.in_flight = 0
        #: the requests sent it, their predicted prefill, and when (the KV router's load)
        self.ledger = LoadLedger()

    def __repr__(self) -> str:
        return f"Worker({self.id!r}, in_flight={self.in_flight})"


class WorkerSetStatistics(NamedTuple):
    """A snapshot of a WorkerSet, from :meth:`WorkerSet.statistics`."""

    workers: int  #: members now
    in_flight: int  #: requests streaming from members (removed members' streams excluded)
    waiting: int  #: requests waiting for a member to appear
    in_flight_by_worker: Mapping[str, int]  #: worker id -> in-flight count


@final
class WorkerSet(Generic[In, Out]):
    """The live membership of one pool of workers.

    Fed by a discovery source through :meth:`add` and :meth:`remove`; read by routers.
    """

    def __init__(self, name: str = "workers", workers: Mapping[str, Engine[In, Out]] | None = None):
        #: a label for error messages and logs
        self.name = name
        self._workers: dict[str, Worker[In, Out]] = {}
        self._members: tuple[Worker[In, Out], ...] = ()
        self._changed: anyio.Event | None = None
        #: requests waiting for a member, woken in priority order
        self._queue: PriorityQueue[anyio.Event] = PriorityQueue()
        #: the waiters of the last change, woken one after another (each by the one before,
        #: once that one has chosen its worker): the first in priority order chooses first
        self._batch: deque[anyio.Event] = deque()
        self._waiting = 0
        self._ever_had_members = False
        self._listeners: list[MembershipListener] = []
        for worker_id, engine in (workers or {}).items():
            self.add(worker_id, engine)

    @property
    def members(self) -> tuple[Worker[In, Out], ...]:
        """The current members, in the order they joined."""
        return self._members

    def get(self, worker_id: str) -> Worker[In, Out] | None:
        """The member with this id, or None."""
        return self._workers.get(worker_id)

    def add(self, worker_id: str, engine: Engine[In, Out]) -> None:
        """Add a worker, or replace the engine of the one with this id.

        A replaced worker keeps its place and its in-flight count (its running streams
        still count against it); new requests get the new engine.
        """
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.engine = engine
        else:
            self._workers[worker_id] = Worker(worker_id, engine)
            self._members = tuple(self._workers.values())
            self._ever_had_members = True
            self._tell(worker_id, joined=True)
        self._notify()

    def remove(self, worker_id: str) -> None:
        """Remove a worker; its in-flight streams go on, new requests no longer reach it."""
        if self._workers.pop(worker_id, None) is not None:
            self._members = tuple(self._workers.values())
            self._tell(worker_id, joined=False)
            self._notify()

    def listen(self, listener: MembershipListener) -> Callable[[], None]:
        """Call ``listener(worker_id, joined)`` each time a worker joins or leaves.

        For state kept per worker elsewhere that must follow at once (a prefix index drops
        a departed worker's blocks before the next decision), which :meth:`wait_changed`
        cannot promise. Called inside :meth:`add` / :meth:`remove`: be quick; exceptions
        are logged. Returns the function that stops the calls.
        """
        self._listeners.append(listener)

        def stop() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return stop

    def _tell(self, worker_id: str, *, joined: bool) -> None:
        for listener in tuple(self._listeners):
            try:
                listener(worker_id, joined)
            except Exception:  # discovery must go on whatever a listener does
                logger.exception("%r: a membership listener failed", self)

    @property
    def lifecycle(self) -> Literal["pending", "active", "unavailable"]:
        """``"pending"`` until the first member joins, ``"active"`` while there are members,
        ``"unavailable"`` once all have left (routers in front of it serve as passthroughs
        or fail, as their kind dictates)."""
        if self._members:
            return "active"
        return "unavailable" if self._ever_had_members else "pending"

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def statistics(self) -> WorkerSetStatistics:
        """How many members, requests in flight, and requests waiting for a member."""
        by_worker = {worker.id: worker.in_flight for worker in self._members}
        return WorkerSetStatistics(
            workers=len(self._members),
            in_flight=sum(by_worker.values()),
            waiting=self._waiting,
            in_flight_by_worker=by_worker,
        )

    async def wait_changed(self) -> None:
        """Wait until the membership changes."""
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    async def wait_available(
        self,
        ctx: Context[Any],
        *,
        wait: float = 0.0,
        accept: Callable[[Sequence[Worker[In, Out]]], bool] = bool,
        wanted: str = "worker",
    ) -> tuple[Worker[In, Out], ...]:
        """Return the members once ``accept(members)`` holds, waiting up to ``wait`` seconds.

        The wait also ends when the context's deadline passes, or when the context is
        stopped: then the members are returned as they are (check ``ctx.is_stopped``). A
        kill cancels the wait like any other. ``wanted`` names what is waited for in the
        error message. When the membership changes, the waiting requests are woken in
        :mod:`pipeline.priority` order (``ctx.data.priority``, then arrival).

        Raises:
            CapacityExhausted: when no acceptable member appeared in time.
        """
        if accept(self._members) or ctx.is_stopped:
            return self._members
        start = anyio.current_time()
        deadline = start + wait
        if ctx.deadline is not None:
            deadline = min(deadline, ctx.deadline)
        key = admission_key(priority_of(ctx.data), start)
        self._waiting += 1
        turn: anyio.Event | None = None
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                while not accept(self._members) and not ctx.is_stopped:
                    if turn is not None:  # woken, yet not accepted: the next one's turn
                        self._wake_next()
                    turn = anyio.Event()
                    self._queue.push(key, turn)
                    async with anyio.create_task_group() as tg:

                        async def stopped(tg: anyio.abc.TaskGroup = tg) -> None:
                            await ctx.wait_stopped()
                            tg.cancel_scope.cancel()

                        tg.start_soon(stopped)
                        await turn.wait()
                        tg.cancel_scope.cancel()
        finally:
            self._waiting -= 1
            if turn is not None:
                if turn.is_set():  # its turn came: the next one's comes once it has chosen
                    self._wake_next()
                elif not self._queue.remove(turn) and turn in self._batch:
                    self._batch.remove(turn)
        if accept(self._members) or ctx.is_stopped:
            return self._members
        waited = "" if wait == 0 else f" after waiting {anyio.current_time() - start:.3g}s"
        raise CapacityExhausted(
            f"no {wanted} available in worker set {self.name!r}{waited}", request_id=ctx.id
        )

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        queue = self._queue
        if not queue:
            return
        batch = self._batch
        idle = not batch
        while queue:  # in priority order: the first chooses its worker first
            batch.append(queue.pop())
        if idle:
            self._wake_next()

    def _wake_next(self) -> None:
        if self._batch:
            self._batch.popleft().set()

    def __repr__(self) -> str:
        return f"WorkerSet({self.name!r}, {[w.id for w in self._members]})"


@final
class MemoryDiscovery(Generic[In, Out]):
    """In-process discovery: workers register here; attached WorkerSets follow along."""

    def __init__(self) -> None:
        self._engines: dict[str, Engine[In, Out]] = {}
        self._sets: list[WorkerSet[In, Out]] = []

    def register(self, worker_id: str, engine: Engine[In, Out]) -> None:
        """Announce a worker to every attached WorkerSet."""
        self._engines[worker_id] = engine
        for worker_set in self._sets:
            worker_set.add(worker_id, engine)

    def deregister(self, worker_id: str) -> None:
        """Withdraw a worker from every attached WorkerSet."""
        self._engines.pop(worker_id, None)
        for worker_set in self._sets:
            worker_set.remove(worker_id)

    def attach(self, worker_set: WorkerSet[In, Out]) -> WorkerSet[In, Out]:
        """Feed ``worker_set`` with the current workers and every later change."""
        for worker_id, engine in self._engines.items():
            worker_set.add(worker_id, engine)
        self._sets.append(worker_set)
        return worker_set

    def detach(self, worker_set: WorkerSet[In, Out]) -> None:
        """Stop feeding ``worker_set``."""
        self._sets.remove(worker_set)


class RoutingPolicy(Protocol):
    """Chooses one worker for a request from a non-empty candidate list."""

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """Pick the worker; ``workers`` is never empty."""
        ...


@final
class RoundRobin:
    """Each request goes to the next member, cycling across the current membership."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """The next member in turn."""
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker


@final
class Random:
    """Each request goes to a uniformly random member."""

    __slots__ = ("_random",)

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """A random member."""
        return workers[self._random.randrange(len(workers))]


@final
class LeastLoaded:
    """Each request goes to the member with the fewest requests in flight (first on ties)."""

    __slots__ = ()

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """The least busy member."""
        return min(workers, key=lambda worker: worker.in_flight)


def _worker_id_from_metadata(ctx: Context[Any]) -> str | None:
    return ctx.metadata.get("worker_id")


@final
class Direct:
    """Each request goes to the worker whose id ``select(ctx)`` names.

    By default the id comes from ``ctx.metadata["worker_id"]``.
    """

    __slots__ = ("_select",)

    def __init__(
        self, select: Callable[[Context[Any]], str | None] = _worker_id_from_metadata
    ) -> None:
        self._select = select

    def target(self, ctx: Context[Any]) -> str | None:
        """The worker id this request asks for."""
        return self._select(ctx)

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """The named member.

        Raises:
            CapacityExhausted: when no member has that id.
        """
        target = self._select(ctx)
        for worker in workers:
            if worker.id == target:
                return worker
        raise CapacityExhausted(f"worker {target!r} is not available", request_id=ctx.id)


@final
class Router(Generic[In, Out]):
    """An Engine that sends each request to one member of a WorkerSet.

    ``wait`` is how long a request may wait for a member to appear before
    :class:`~pipeline.errors.CapacityExhausted` (0: fail at once). The context bounds the
    wait too: ``stop_generating()`` ends it with an empty stream, ``kill()`` cancels it,
    and a deadline that passes first is, under :func:`~pipeline.open_stream`, a kill like
    anywhere else (without a driver, the router raises CapacityExhausted at the deadline).
    """

    def __init__(
        self,
        workers: WorkerSet[In, Out],
        policy: RoutingPolicy | None = None,
        *,
        wait: float = 0.0,
    ) -> None:
        self.workers = workers
        self.policy: RoutingPolicy = RoundRobin() if policy is None else policy
        self._wait = wait

    def _accept(self, ctx: Context[Any]) -> Callable[[Sequence[Worker[In, Out]]], bool]:
        policy = self.policy
        if isinstance(policy, Direct):
            target = policy.target(ctx)
            return lambda members: any(worker.id == target for worker in members)
        return bool

    def _wanted(self, ctx: Context[Any]) -> str:
        policy = self.policy
        if isinstance(policy, Direct):
            return f"worker {policy.target(ctx)!r}"
        return "worker"

    async def generate(self, ctx: Context[In], /) -> Stream[Out]:
        """Pick a worker for ``ctx`` and stream its outputs (a traced request's span says
        which: ``llm_pipeline.worker.id``)."""
        members = self.workers.members
        if not members or isinstance(self.policy, Direct):
            members = await self.workers.wait_available(
                ctx, wait=min(self._wait, 1e9), accept=self._accept(ctx), wanted=self._wanted(ctx)
            )
        if ctx.is_stopped:
            return
        worker = self.policy.choose(members, ctx)
        span = ctx.span
        if span is not None:
            span.set("llm_pipeline.worker.id", worker.id)
            span.set("llm_pipeline.worker.set", self.workers.name)
        state = ctx.state
        ledger = worker.ledger
        if PREDICTED_PREFILL in state:
            predicted = state.pop(PREDICTED_PREFILL)
            now = anyio.current_time()
            sent = ledger.sent(predicted.tokens, now, predicted.blocks, predicted.prompt)
        else:
            sent = ledger.sent(0.0, anyio.current_time())
        worker.in_flight += 1
        try:
            async with aclosing(worker.engine.generate(ctx)) as stream:
                async for item in stream:
                    if sent.prefilling:  # the first output: its prefill is done
                        ledger.prefilled(sent)
                    yield item
        finally:
            worker.in_flight -= 1
            ledger.ended(sent)

    def statistics(self) -> WorkerSetStatistics:
        """The worker set's statistics."""
        return self.workers.statistics()

    def __repr__(self) -> str:
        return f"Router({self.workers!r}, {type(self.policy).__name__})"
