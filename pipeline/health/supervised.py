"""One engine under watch: :class:`Supervised`.

The gate every request to the engine passes: it counts the requests waiting on the engine
and the outputs that come back, refuses requests while the engine cannot answer, and ends
the requests of an engine that stalled or died. The judging (each tick of
:meth:`pipeline.health.Health.run`) is :meth:`Supervised.tick`; probes and restarts run in
the health's task group. The package docstring (:mod:`pipeline.health`) says why.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, final

import anyio

from pipeline.errors import EngineDead, EngineStalled, EngineUnavailable
from pipeline.streams import FunctionEngine

from .common import (
    PROBE_RETRY,
    PROBE_TIMEOUT,
    RETRY_AFTER,
    EngineState,
    Probe,
    RestartBudget,
    close_engine,
    lost_to,
    mark_lost,
)

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from pipeline.context import Context
    from pipeline.operator import Engine, Stream
    from pipeline.routers import WorkerSet

__all__ = ("Supervised",)

#: why an engine given with ``first_probe`` is not ready yet
FIRST_PROBE = "starting: its engine has not answered a probe yet"

logger = logging.getLogger("pipeline.health")

In = TypeVar("In")
Out = TypeVar("Out")


@final
class Supervised(Generic[In, Out]):
    """An Engine that watches ``engine``: stalls, a canary, and rebuilds from ``factory``.

    Args:
        engine: the engine to serve (None: ``factory`` builds the first one, and the
            engine is ``starting`` until then; requests wait).
        factory: builds a replacement when the engine dies (raises
            :class:`~pipeline.EngineDead`, or its ``dead`` attribute says why); without
            one a death is beyond recovery.
        name: how logs and reasons name it (a worker id, a model).
        stall_timeout: seconds without progress, while requests wait on it, before the
            engine is judged stalled (None: never).
        probe: one small request and its answer (:data:`Probe`); tests a stalled or
            rebuilt engine before it is ready again, and is the canary. Without one, an
            engine is ready again once it shows progress (a rebuilt one at once).
        canary_interval: seconds an idle, ready engine waits before ``probe`` checks it
            (0: no canary).
        restarts, restart_window: at most ``restarts`` rebuilds within any
            ``restart_window`` seconds; one more death is beyond recovery (``dead``).
        first_probe: an ``engine`` given is ``starting`` until ``probe`` first answers,
            as a rebuilt one is (False: ready at once). A worker that joins a fleet
            wants it: it says it is ready, and frontends route to it, only once its
            engine has answered, not merely loaded.

    What counts as progress: an output, or the engine's own ``progress`` attribute moving
    (an int it raises with every unit of work the outputs do not show: a prefill chunk).
    What tells of a death: :class:`~pipeline.EngineDead` from a stream, or the engine's
    ``dead`` attribute (why it died, None while alive) — noticed even while idle.

    Everything else is the engine's: other attributes are read from the engine serving
    now (its ``features``, ``statistics()``...), and a KV event sink set here is set again
    on a rebuilt engine.
    """

    def __init__(
        self,
        engine: Engine[In, Out] | None = None,
        *,
        factory: Callable[[], Awaitable[Engine[In, Out]]] | None = None,
        name: str = "engine",
        stall_timeout: float | None = 30.0,
        probe: Probe | None = None,
        canary_interval: float = 0.0,
        restarts: int = 3,
        restart_window: float = 300.0,
        first_probe: bool = False,
    ) -> None:
        if engine is None and factory is None:
            raise TypeError("give the engine, or a factory that builds it")
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {stall_timeout}")
        if canary_interval < 0:
            raise ValueError(f"canary_interval must be >= 0, got {canary_interval}")
        self._engine = engine
        self._factory = factory
        self.name = name
        self.stall_timeout = stall_timeout
        self._probe = probe
        self.canary_interval = canary_interval
        self._budget = RestartBudget(restarts, restart_window)
        unproven = engine is None or (first_probe and probe is not None)
        self._state: EngineState = "starting" if unproven else "ready"
        self._reason: str | None = (
            None if not unproven else "starting" if engine is None else FIRST_PROBE
        )
        #: stalls so far
        self.stalls = 0
        self._outputs = 0  # outputs delivered, ever
        #: each request in flight and its stream (a generator of ours: see ``waiting``)
        self._inflight: weakref.WeakValueDictionary[Context[Any], Any] = (
            weakref.WeakValueDictionary()
        )
        self._seen = -1  # the progress count at the last tick
        self._progress_at = -math.inf  # when it last moved (or nobody waited)
        self._active_at = -math.inf  # when a request was last in flight
        self._changed: anyio.Event | None = None
        self._listeners: list[Callable[[Supervised[In, Out]], None]] = []
        self._busy = False  # a probe or rebuild runs
        self._next_probe = -math.inf
        self._closing: Engine[In, Out] | None = None  # a dead engine its rebuild closes
        self._previous: Engine[In, Out] | None = None  # the last engine, while none serves
        self._sink: Any = None  # the KV event sink set on it, set again on a rebuilt one

    # ------------------------------------------------------------------ what it tells

    @property
    def engine(self) -> Engine[In, Out] | None:
        """The engine serving now (None while the first is built or a dead one rebuilt)."""
        return self._engine

    @property
    def state(self) -> EngineState:
        """Where it is (:data:`EngineState`)."""
        return self._state

    @property
    def ready(self) -> bool:
        """Whether it takes requests now."""
        return self._state == "ready"

    @property
    def reason(self) -> str | None:
        """Why it is not ready (None when it is)."""
        return self._reason

    @property
    def restarts(self) -> int:
        """Rebuilds started so far."""
        return self._budget.spent

    @property
    def waiting(self) -> int:
        """Requests waiting on the engine's next output now: their stream (a generator of
        ours) is suspended in its wait for the engine (``ag_await``), not at its ``yield``
        with an output its consumer has not asked past. Asked of the generators when
        judged, so that an output costs nothing but a count."""
        return sum(1 for stream in list(self._inflight.values()) if stream.ag_await is not None)

    def on_change(self, listener: Callable[[Supervised[In, Out]], None]) -> Callable[[], None]:
        """Call ``listener(self)`` at every change of state (be quick: it runs in the
        watchdog); returns the function that stops the calls."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def member_of(self, workers: WorkerSet[In, Out], worker_id: str) -> None:
        """Keep this engine in ``workers`` as ``worker_id`` only while it is ready, so that
        routers send new requests (and Migration's retries) to the others meanwhile (from
        now: one not ready yet, waiting for its first probe, leaves at once)."""

        def follow(engine: Supervised[In, Out]) -> None:
            if engine.ready:
                if worker_id not in workers:
                    workers.add(worker_id, engine)
            elif worker_id in workers:
                workers.remove(worker_id)

        self.on_change(follow)
        follow(self)

    # ------------------------------------------------------------------------ requests

    def generate(self, ctx: Context[In], /) -> Stream[Out]:
        """Stream ``ctx`` from the engine, counting what it waits for and gets (one hop
        per output while the engine is ready).

        Raises:
            EngineUnavailable: the engine is stalled, failing or dead (or restarting after
                this request was lost to it): at once, instead of a hang.
            EngineStalled, EngineDead: the engine stalled or died under the request
                (from the driver: :meth:`pipeline.Context.fail`).
        """
        engine = self._engine
        if self._state == "ready" and engine is not None:
            return self._open(engine, ctx)
        return self._admitted(ctx)

    async def _admitted(self, ctx: Context[In]) -> Stream[Out]:
        engine = await self._admit(ctx)
        async for item in self._open(engine, ctx):
            yield item

    def _open(self, engine: Engine[In, Out], ctx: Context[In]) -> Stream[Out]:
        stream = self._stream(engine, ctx)
        self._inflight[ctx] = stream
        return stream

    async def _stream(self, engine: Engine[In, Out], ctx: Context[In]) -> AsyncGenerator[Out]:
        inner = engine.generate(ctx)
        try:
            async for item in inner:
                self._outputs += 1
                yield item
        except EngineDead as exc:
            mark_lost(ctx, self)
            self._died(engine, exc.message)
            raise
        finally:
            self._inflight.pop(ctx, None)
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _admit(self, ctx: Context[In]) -> Engine[In, Out]:
        """The engine, once ready; waits while it starts or restarts (within the
        request's deadline: the driver's scope), refuses otherwise."""
        while True:
            state, engine = self._state, self._engine
            if state == "ready" and engine is not None:
                return engine
            if state not in ("starting", "restarting") or lost_to(ctx, self):
                raise EngineUnavailable(
                    f"{self.name} is unavailable: {self._reason}",
                    retry_after=RETRY_AFTER,
                    request_id=ctx.id,
                )
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    # --------------------------------------------------------------------- the watchdog

    def tick(self, now: float, tg: TaskGroup) -> None:
        """Judge the engine at ``now`` (the event loop's clock); probes and rebuilds start
        in ``tg``. :meth:`pipeline.health.Health.run` calls it every tick."""
        engine = self._engine
        if self._state == "dead":
            return
        if engine is None:
            if not self._busy:  # the first build (or a rebuild the death could not start)
                self._busy = True
                tg.start_soon(self._rebuild, None)
            return
        dead = getattr(engine, "dead", None)
        if dead:
            self._died(engine, str(dead))
            return
        progress = getattr(engine, "progress", 0)
        moved = self._outputs + (progress if isinstance(progress, int) else 0)
        if self._inflight:
            self._active_at = now
        waiting = self.waiting
        if moved != self._seen or not waiting:
            if moved != self._seen and self._seen >= 0 and self._probe is None:
                if self._state in ("stalled", "failing"):
                    self._set("ready", None)  # no probe to ask: progress is the answer
            self._seen = moved
            self._progress_at = now
        elif (
            self.stall_timeout is not None
            and self._state != "stalled"  # (its probe waits for it as long as it takes)
            and now - self._progress_at >= self.stall_timeout
        ):
            self._stall(now, waiting)
        if self._busy or self._probe is None:
            return
        if self._state in ("starting", "stalled", "failing"):  # (starting: a first probe)
            if now >= self._next_probe:
                self._start_probe(tg, canary=False)
        elif self._state == "ready" and self.canary_interval and not self._inflight:
            if now - max(self._active_at, self._next_probe) >= self.canary_interval:
                self._start_probe(tg, canary=True)

    def _stall(self, now: float, waiting: int) -> None:
        """No progress for the stall timeout with requests waiting: fail what is in flight
        (Migration finishes each elsewhere, or it ends with a 503) and take no more."""
        silent = now - self._progress_at
        why = f"engine stalled: no output for {silent:.1f} s with {waiting} requests waiting"
        self._progress_at = now  # the next stall is judged from now
        if self._state == "ready":
            self.stalls += 1
            logger.warning("%s: %s", self.name, why)
            self._set("stalled", why)
        for ctx in list(self._inflight):
            mark_lost(ctx, self)
            ctx.fail(EngineStalled(f"{self.name}: {why}", request_id=ctx.id))

    def _died(self, engine: Engine[In, Out], why: str) -> None:
        """``engine`` died: fail its requests, and rebuild it if the budget allows."""
        if engine is not self._engine or self._state == "dead":
            return  # already handled (several streams report one death)
        self._engine, self._previous = None, engine
        for ctx in list(self._inflight):
            mark_lost(ctx, self)
            ctx.fail(EngineDead(f"{self.name} died: {why}", request_id=ctx.id))
        spent = (
            "it has no factory to rebuild it"
            if self._factory is None
            else self._budget.spend(anyio.current_time())
        )
        if spent is not None:
            self._dead(f"engine died ({why}); beyond recovery: {spent}", engine)
            return
        budget = self._budget
        logger.warning("%s died (%s): restarting it (%d of %d)", self.name, why,
                       len(budget.recent), budget.restarts)  # fmt: skip
        self._set("restarting", f"engine died ({why}); restarting")
        self._closing = engine

    def _dead(self, why: str, engine: Engine[In, Out] | None) -> None:
        self._set("dead", why)  # (said once, by whoever ends the process: Health.dead)
        if engine is not None:
            self._closing = engine

    def _set(self, state: EngineState, reason: str | None) -> None:
        if state == self._state and reason == self._reason:
            return
        self._state, self._reason = state, reason
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()  # waiting admissions look again
        for listener in tuple(self._listeners):
            try:
                listener(self)
            except Exception:  # the watchdog must go on whatever a listener does
                logger.exception("%s: a listener of its health failed", self.name)

    # ---------------------------------------------------------------- probes, rebuilds

    def _start_probe(self, tg: TaskGroup, *, canary: bool) -> None:
        self._busy = True
        tg.start_soon(self._probe_once, canary)

    async def _probe_once(self, canary: bool) -> bool:
        """Probe the engine; ready on an answer, ``failing`` on an error (a death is a
        death, a stall the watchdog's). True when it answered."""
        probe, engine = self._probe, self._engine
        assert probe is not None
        if engine is None:
            self._busy = False
            return False
        try:
            limit = PROBE_TIMEOUT if self.stall_timeout is None else math.inf
            with anyio.fail_after(limit):
                # (counted and watched like any request, never refused)
                await probe(FunctionEngine(functools.partial(self._open, engine)))
        except EngineDead as exc:
            self._died(engine, exc.message)
            return False
        except Exception as exc:
            # (a stall the watchdog judged already keeps its own state and reason)
            if engine is self._engine and self._state not in ("stalled", "dead"):
                why = f"{'canary' if canary else 'probe'} failed: {type(exc).__name__}: {exc}"
                if self._state != "failing":
                    logger.warning("%s: %s", self.name, why)
                self._set("failing", why)
            return False
        else:
            if engine is self._engine and self._state in ("starting", "stalled", "failing"):
                again = "" if self._state == "starting" else " again"
                logger.info("%s answers%s: ready", self.name, again)
                self._set("ready", None)
            return True
        finally:
            self._next_probe = anyio.current_time() + (0 if canary else PROBE_RETRY)
            self._busy = False

    async def _rebuild(self, _: object) -> None:
        """Close the dead engine, build another, probe it: ready, or dead past the budget."""
        try:
            closing, self._closing = self._closing, None
            if closing is not None:
                await close_engine(closing, self.name)
            assert self._factory is not None
            while self._state != "dead":
                try:
                    engine = await self._factory()
                except Exception as exc:
                    spent = self._budget.spend(anyio.current_time())
                    if spent is not None:
                        self._dead(f"its rebuild failed: {exc!r}; beyond recovery: {spent}", None)
                        return
                    await anyio.sleep(PROBE_RETRY)
                    continue
                if self._sink is not None and hasattr(engine, "kv_events"):
                    cast("Any", engine).kv_events = self._sink
                self._engine, self._previous = engine, None
                self._seen, self._progress_at = -1, anyio.current_time()
                if self._probe is None or await self._probe_once(canary=False):
                    logger.info("%s is ready", self.name)
                    self._set("ready", None)
                return  # (a failed probe: failing, probed again like any engine)
        finally:
            self._busy = False

    async def aclose(self) -> None:
        """Close the engine serving now (and a dead one not closed yet)."""
        closing, engine = self._closing, self._engine
        self._closing = self._engine = None
        for each in (closing, engine):
            if each is not None:
                await close_engine(each, self.name)

    # ------------------------------------------------------------- the engine's own

    @property
    def kv_events(self) -> Any:
        """The engine's KV event sink (:class:`~pipeline.KvEventSink`), set again on a
        rebuilt engine."""
        return getattr(self._engine, "kv_events", self._sink)

    @kv_events.setter
    def kv_events(self, sink: Any) -> None:
        self._sink = sink
        if self._engine is not None and hasattr(self._engine, "kv_events"):
            cast("Any", self._engine).kv_events = sink

    def __getattr__(self, name: str) -> Any:
        """What the engine has besides (its ``features``, ``statistics()``, ``embed``...),
        read from the engine serving now (while one is rebuilt: the one that died, so that
        a scrape of its statistics still answers)."""
        if name.startswith("_"):
            raise AttributeError(name)
        engine = self._engine if self._engine is not None else self._previous
        if engine is None:
            raise AttributeError(f"{self.name} has no engine yet to read {name!r} from")
        return getattr(engine, name)

    def __repr__(self) -> str:
        return f"Supervised({self.name!r}, {self._state})"
