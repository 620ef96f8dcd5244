"""What a process tells its orchestrator: :class:`Health`, over the engines it hosts and
the workers it routes to, by model.

The package docstring (:mod:`pipeline.health`) says why; this module keeps the books: which
sources tell each model's readiness, which engines this process hosts (for liveness), and
the one task that judges them all (:meth:`Health.run`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

import anyio

from pipeline.errors import EngineUnavailable
from pipeline.routers import WorkerSet

from .common import RETRY_AFTER
from .supervised import Supervised

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

__all__ = ("TICK", "Health", "ModelHealth")

logger = logging.getLogger("pipeline.health")

#: the longest time between two judgements of an engine, seconds (shorter for short
#: stall timeouts and canary intervals: a tenth of the shortest)
TICK: Final = 0.5

_Source = Supervised[Any, Any] | WorkerSet[Any, Any]


class ModelHealth(NamedTuple):
    """One model's readiness, from :meth:`Health.model`."""

    ready: bool  #: at least one of its engines or workers takes requests now
    reason: str | None  #: why not (None when ready)


@final
class Health:
    """The health of one process: is it alive, is each model it serves ready, and why not.

    Models are told by their sources (:meth:`watch`): :class:`~.supervised.Supervised`
    engines hosted here (ready when one of them is), or a :class:`~pipeline.WorkerSet`
    (ready while it has members: workers elsewhere, whose own health decides whether
    they are members). The process is *live* until an engine it hosts is dead beyond
    recovery. Nothing is judged unless :meth:`run` runs (one task for every engine).
    """

    def __init__(self) -> None:
        self._models: dict[str, list[_Source]] = {}
        self._hosted: list[Supervised[Any, Any]] = []
        self._dead: str | None = None
        self._died: anyio.Event | None = None
        self._stops: dict[str, list[Callable[[], None]]] = {}

    # ------------------------------------------------------------------------ the books

    def watch(self, model: str, source: _Source, *, serves: bool = True) -> None:
        """Count ``source`` in ``model``'s health.

        ``serves=False``: a supervised engine hosted here whose readiness does not make the
        model's (a prefill worker: the decode workers prefill without it) still counts for
        the process's liveness and health.
        """
        if serves:
            self._models.setdefault(model, []).append(source)
        else:
            self._models.setdefault(model, [])
        if isinstance(source, Supervised) and source not in self._hosted:
            self._hosted.append(source)
            stop = source.on_change(self._changed)
            self._stops.setdefault(model, []).append(stop)
            self._changed(source)

    def forget(self, model: str) -> None:
        """Stop telling ``model`` (no longer served); its engines are no longer judged."""
        sources = self._models.pop(model, [])
        for stop in self._stops.pop(model, []):
            stop()
        gone = {id(source) for source in sources}
        self._hosted = [engine for engine in self._hosted if id(engine) not in gone]

    @property
    def engines(self) -> tuple[Supervised[Any, Any], ...]:
        """The supervised engines this process hosts."""
        return tuple(self._hosted)

    @property
    def names(self) -> tuple[str, ...]:
        """The models told, in the order they were first watched."""
        return tuple(self._models)

    def sources(self, model: str) -> tuple[_Source, ...]:
        """What tells ``model``'s readiness."""
        return tuple(self._models.get(model, ()))

    # ------------------------------------------------------------------------- answers

    @property
    def live(self) -> bool:
        """False once an engine hosted here is dead beyond recovery: the process should be
        restarted (Kubernetes' liveness)."""
        return self._dead is None

    @property
    def dead(self) -> str | None:
        """Why the process is no longer live (None while it is)."""
        return self._dead

    async def wait_dead(self) -> str:
        """Wait until an engine hosted here is dead beyond recovery; why."""
        if self._dead is None:
            if self._died is None:
                self._died = anyio.Event()
            await self._died.wait()
        assert self._dead is not None
        return self._dead

    def trouble(self) -> str | None:
        """Why this process is not in health (an engine it hosts is starting, stalled,
        failing, restarting or dead), or None."""
        troubled = [f"{each.name}: {each.reason}" for each in self._hosted if not each.ready]
        return "; ".join(troubled) if troubled else None

    def model(self, name: str) -> ModelHealth | None:
        """``name``'s readiness (None: nothing tells it, so nothing is known against it)."""
        sources = self._models.get(name)
        if sources is None:
            return None
        reasons = []
        for source in sources:
            if isinstance(source, Supervised):
                if source.ready:
                    return ModelHealth(True, None)
                reasons.append(f"{source.name}: {source.reason}")
            elif len(source):
                return ModelHealth(True, None)
            else:
                reasons.append(_no_workers(source))
        return ModelHealth(False, "; ".join(reasons) or "no engine")

    def refusal(self, model: str) -> EngineUnavailable | None:
        """What a new request for ``model`` gets at once, instead of waiting on an engine
        known not to answer: None unless every engine of the model is stalled, failing or
        dead (one starting or restarting makes it wait; workers elsewhere are their
        router's to wait for)."""
        sources = self._models.get(model)
        if not sources:
            return None
        reasons = []
        for source in sources:
            if not isinstance(source, Supervised):
                return None
            if source.ready or source.state in ("starting", "restarting"):
                return None
            reasons.append(f"{source.name}: {source.reason}")
        return EngineUnavailable(
            f"model {model!r} is unavailable: {'; '.join(reasons)}", retry_after=RETRY_AFTER
        )

    # ----------------------------------------------------------------------- the judge

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Judge every hosted engine each tick, until cancelled: stalls, deaths, canaries;
        probes and rebuilds run in this task's group. ``task_status`` is told at once."""
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                now = anyio.current_time()
                for engine in tuple(self._hosted):
                    engine.tick(now, tg)
                await anyio.sleep(self._tick())

    def _tick(self) -> float:
        tick = TICK
        for engine in self._hosted:
            for period in (engine.stall_timeout, engine.canary_interval):
                if period:
                    tick = min(tick, period / 10)
        return max(tick, 0.01)

    def _changed(self, engine: Supervised[Any, Any]) -> None:
        if engine.state == "dead" and self._dead is None:
            self._dead = f"{engine.name}: {engine.reason}"
            if self._died is not None:
                self._died.set()

    def __repr__(self) -> str:
        return f"Health({list(self._models)}, live={self.live})"


def _no_workers(workers: WorkerSet[Any, Any]) -> str:
    if workers.lifecycle == "pending":
        return f"no worker has joined {workers.name!r} yet"
    return f"no ready worker in {workers.name!r}"
