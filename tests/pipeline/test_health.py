"""pipeline.health: the watchdog, the probe and canary, rebuilds, and readiness by model.

The engines here are driven by events (a test releases, freezes or kills them); the
watchdog is real (its ticks are real time, scaled down by short stall timeouts), and a test
waits for a change of state by the state's own notification, never by sleeping.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from pipeline import (
    Context,
    EngineDead,
    EngineStalled,
    EngineUnavailable,
    WorkerLost,
    WorkerSet,
    open_stream,
)
from pipeline.health import Health, Supervised

STALL = 0.3  # seconds: short, so that the tests are


class Valve:
    """An engine whose outputs flow while its valve is open: ``freeze()`` holds every
    stream (an engine stopped with SIGSTOP), ``thaw()`` lets them go on; ``die()`` makes
    every stream raise EngineDead (its process killed)."""

    def __init__(self, name: str = "valve", *, tokens: int = 3) -> None:
        self.name = name
        self.tokens = tokens
        self.open = anyio.Event()
        self.open.set()
        self.dead: str | None = None
        self.progress = 0
        self.closed = False
        self.features = frozenset({"valve"})
        self._died = anyio.Event()

    def freeze(self) -> None:
        self.open = anyio.Event()

    def thaw(self) -> None:
        self.open.set()

    def die(self, why: str = "killed") -> None:
        self.dead = why
        self._died.set()

    async def _wait(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        async with anyio.create_task_group() as tg:

            async def died() -> None:
                await self._died.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(died)
            await self.open.wait()
            tg.cancel_scope.cancel()
        if self.dead is not None:
            raise EngineDead(self.dead)

    async def generate(self, ctx: Context[str]) -> AsyncIterator[str]:
        for i in range(self.tokens):
            await self._wait()
            yield f"{self.name}:{ctx.data}:{i}"

    async def aclose(self) -> None:
        self.closed = True


async def collect(engine: Any, data: str = "x") -> list[str]:
    async with open_stream(engine, Context.new(data)) as stream:
        return [item async for item in stream]


async def until(engine: Supervised[Any, Any], condition: Callable[[], bool]) -> None:
    """Wait (by its change notifications) until ``condition()`` holds."""
    changed = anyio.Event()
    stop = engine.on_change(lambda _: changed.set())
    try:
        while not condition():
            await changed.wait()
            changed = anyio.Event()
    finally:
        stop()


async def probe(engine: Any) -> None:
    await collect(engine, "probe")


async def test_a_supervised_engine_passes_everything_through() -> None:
    engine = Supervised(Valve(), name="w")
    assert await collect(engine, "a") == ["valve:a:0", "valve:a:1", "valve:a:2"]
    assert engine.features == frozenset({"valve"})  # (the engine's own, read through)
    assert engine.ready
    assert engine.state == "ready"
    assert engine.reason is None
    assert engine.waiting == 0


async def test_a_stalled_engine_fails_its_requests_and_refuses_new_ones_at_once() -> None:
    valve = Valve()
    engine = Supervised(valve, name="w", stall_timeout=STALL)
    health = Health()
    health.watch("m", engine)
    outputs: list[str] = []
    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        ctx = Context.new("a")
        with pytest.raises(EngineStalled, match="engine stalled: no output for"):
            async with open_stream(engine, ctx) as stream:
                async for output in stream:
                    outputs.append(output)
                    valve.freeze()
        assert outputs == ["valve:a:0"]
        assert not ctx.is_killed  # failed with a reason, not cancelled as by its client
        assert engine.state == "stalled"
        assert engine.stalls == 1
        assert "1 requests waiting" in (engine.reason or "")
        with anyio.fail_after(0.1):  # at once, not after a stall timeout
            with pytest.raises(EngineUnavailable) as refused:
                await collect(engine)
        assert refused.value.retry_after >= 1
        model = health.model("m")
        assert model is not None
        assert not model.ready
        assert "stalled" in (model.reason or "")
        assert isinstance(health.refusal("m"), EngineUnavailable)
        assert health.live
        assert health.trouble() is not None
        tg.cancel_scope.cancel()


async def test_a_stalled_engine_is_ready_again_once_its_probe_is_answered() -> None:
    valve = Valve()
    engine = Supervised(valve, name="w", stall_timeout=STALL, probe=probe)
    health = Health()
    health.watch("m", engine)
    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        valve.freeze()
        with pytest.raises(EngineStalled):
            await collect(engine)
        await until(engine, lambda: engine.waiting == 1)  # the probe, waiting on it
        assert engine.state == "stalled"  # (its probe waits as long as it takes)
        valve.thaw()
        await until(engine, lambda: engine.ready)
        assert await collect(engine, "b") == ["valve:b:0", "valve:b:1", "valve:b:2"]
        assert health.model("m") == (True, None)
        assert health.refusal("m") is None
        tg.cancel_scope.cancel()


async def test_a_consumer_that_stops_reading_is_not_a_stall() -> None:
    engine = Supervised(Valve(tokens=2), name="w", stall_timeout=STALL)
    health = Health()
    health.watch("m", engine)
    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        async with open_stream(engine, Context.new("a")) as stream:
            first = await stream.__anext__()
            await anyio.sleep(3 * STALL)  # the reader is slow: the engine waits on it
            rest = [item async for item in stream]
        assert [first, *rest] == ["valve:a:0", "valve:a:1"]
        assert engine.ready
        assert engine.stalls == 0
        tg.cancel_scope.cancel()


async def test_reported_progress_is_not_a_stall() -> None:
    """A long prefill: no output for longer than the stall timeout, but work reported."""
    valve = Valve(tokens=1)
    engine = Supervised(valve, name="w", stall_timeout=STALL)
    health = Health()
    health.watch("m", engine)

    async def prefill() -> None:
        for _ in range(int(4 * STALL / 0.05)):
            await anyio.sleep(0.05)
            valve.progress += 1  # a chunk of the prompt
        valve.thaw()

    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        valve.freeze()
        tg.start_soon(prefill)
        assert await collect(engine) == ["valve:x:0"]
        assert engine.ready
        assert engine.stalls == 0
        tg.cancel_scope.cancel()


async def test_a_dead_engine_is_rebuilt_and_requests_wait_for_it() -> None:
    built: list[Valve] = []
    rebuild = anyio.Event()

    async def factory() -> Valve:
        await rebuild.wait()
        built.append(Valve(f"v{len(built) + 1}"))
        return built[-1]

    first = Valve("v0")
    engine = Supervised(first, factory=factory, name="w", probe=probe, restarts=1)
    health = Health()
    health.watch("m", engine)
    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        ctx = Context.new("a")
        with pytest.raises(EngineDead):
            async with open_stream(engine, ctx) as stream:
                async for _ in stream:
                    first.die()
        assert isinstance(EngineDead("x"), WorkerLost)  # Migration retries it elsewhere
        assert engine.state == "restarting"
        assert engine.restarts == 1
        assert engine.features == frozenset({"valve"})  # (the dead one's, while rebuilt)
        assert health.refusal("m") is None  # (a new request waits for the rebuild)
        with anyio.fail_after(0.1):  # the request lost to it does not wait for it
            with pytest.raises(EngineUnavailable):
                await _retry(engine, ctx)
        served: list[list[str]] = []
        answered = anyio.Event()

        async def new_request() -> None:
            served.append(await collect(engine, "b"))
            answered.set()

        tg.start_soon(new_request)
        await anyio.wait_all_tasks_blocked()  # it waits for the rebuild
        assert not served
        rebuild.set()
        await answered.wait()
        assert served == [["v1:b:0", "v1:b:1", "v1:b:2"]]
        assert engine.ready
        assert first.closed
        assert health.live
        built[0].die("again")  # noticed while idle, by its ``dead`` attribute
        reason = await health.wait_dead()
        assert engine.state == "dead"
        assert not health.live
        assert "beyond recovery: 1 restarts within 300 s" in reason
        assert built[0].closed is False  # closed with the process, not by the watchdog
        await engine.aclose()
        assert built[0].closed
        tg.cancel_scope.cancel()


async def _retry(engine: Supervised[Any, Any], ctx: Context[str]) -> list[str]:
    """What Migration does: the same request again, as a child leg sharing its state."""
    leg = ctx.child(ctx.data)
    async with open_stream(engine, leg) as stream:
        return [item async for item in stream]


async def test_an_engine_without_a_factory_is_dead_at_its_first_death() -> None:
    valve = Valve()
    engine = Supervised(valve, name="w")
    health = Health()
    health.watch("m", engine)
    valve.die()
    with pytest.raises(EngineDead):
        await collect(engine)
    assert engine.state == "dead"
    assert "no factory" in (engine.reason or "")
    assert health.dead is not None
    assert "w" in health.dead
    with pytest.raises(EngineUnavailable):
        await collect(engine)


async def test_a_failed_canary_takes_the_engine_out_of_its_worker_set_until_it_answers() -> None:
    answers = anyio.Event()
    failures = 0

    async def canary(engine: Any) -> None:
        nonlocal failures
        if not answers.is_set():
            failures += 1
            raise RuntimeError("wrong answer")
        await collect(engine, "canary")

    engine = Supervised(Valve(), name="w-1", probe=canary, canary_interval=0.2)
    workers: WorkerSet[str, str] = WorkerSet("decode", {"w-1": engine, "w-2": Valve("w-2")})
    engine.member_of(workers, "w-1")
    health = Health()
    health.watch("m", engine)
    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        await until(engine, lambda: engine.state == "failing")
        assert "canary failed: RuntimeError: wrong answer" in (engine.reason or "")
        assert [w.id for w in workers.members] == ["w-2"]
        answers.set()
        await until(engine, lambda: engine.ready)
        assert sorted(w.id for w in workers.members) == ["w-1", "w-2"]
        tg.cancel_scope.cancel()


async def test_an_engine_given_with_first_probe_joins_once_its_probe_answers() -> None:
    valve = Valve()
    valve.freeze()  # loaded, but it would not answer yet
    asked = anyio.Event()

    async def first(engine: Any) -> None:
        asked.set()
        await probe(engine)

    engine = Supervised(valve, name="w-1", probe=first, first_probe=True)
    workers: WorkerSet[str, str] = WorkerSet("decode", {"w-1": engine, "w-2": Valve("w-2")})
    engine.member_of(workers, "w-1")
    assert engine.state == "starting"
    assert "has not answered a probe" in (engine.reason or "")
    assert [w.id for w in workers.members] == ["w-2"]  # no request reaches it
    health = Health()
    health.watch("m", engine)
    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        await asked.wait()  # its first probe, unanswered
        assert not engine.ready
        assert [w.id for w in workers.members] == ["w-2"]
        assert health.model("m") == (False, f"w-1: {engine.reason}")
        valve.thaw()
        await until(engine, lambda: engine.ready)
        assert sorted(w.id for w in workers.members) == ["w-1", "w-2"]
        assert await collect(engine, "a") == ["valve:a:0", "valve:a:1", "valve:a:2"]
        tg.cancel_scope.cancel()


async def test_an_engine_given_without_first_probe_is_ready_at_once() -> None:
    engine = Supervised(Valve(), name="w", probe=probe)  # (as serve's in-process engine)
    assert engine.ready
    assert engine.reason is None


async def test_a_model_of_remote_workers_is_ready_while_its_set_has_members() -> None:
    health = Health()
    workers: WorkerSet[str, str] = WorkerSet("decode")
    health.watch("m", workers)
    assert health.model("m") == (False, "no worker has joined 'decode' yet")
    assert health.refusal("m") is None  # its router waits for workers
    workers.add("a", Valve())
    assert health.model("m") == (True, None)
    workers.remove("a")
    assert health.model("m") == (False, "no ready worker in 'decode'")
    assert health.model("other") is None
    assert health.live
    assert health.trouble() is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(TypeError):
        Supervised()
    with pytest.raises(ValueError, match="stall_timeout"):
        Supervised(Valve(), stall_timeout=0)
    with pytest.raises(ValueError, match="canary_interval"):
        Supervised(Valve(), canary_interval=-1)
