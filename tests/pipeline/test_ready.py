"""next_or_wait: ready items come back untouched; a would-be wait runs on_wait first.

The producer must see exactly what a plain ``await stream.__anext__()`` would show it:
its waits complete, cancellation reaches it at its own await point, and when on_wait fails
the generator is unwound (its ``finally`` runs) instead of being left half-run.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import anyio
import pytest
from anyio.lowlevel import checkpoint

from pipeline import next_or_wait


class Log:
    def __init__(self) -> None:
        self.entries: list[str] = []
        self.closed = False

    async def on_wait(self) -> None:
        self.entries.append("wait")


async def burst_then_wait(log: Log, release: anyio.Event) -> AsyncGenerator[int]:
    try:
        yield 1
        yield 2
        log.entries.append("suspending")
        await release.wait()
        yield 3
    finally:
        log.closed = True


async def test_ready_items_never_call_on_wait() -> None:
    log = Log()
    release = anyio.Event()
    stream = burst_then_wait(log, release)
    assert await next_or_wait(stream.__anext__(), log.on_wait) == 1
    assert await next_or_wait(stream.__anext__(), log.on_wait) == 2
    assert log.entries == []
    release.set()
    await stream.aclose()


async def test_a_wait_runs_on_wait_first_and_then_completes() -> None:
    log = Log()
    release = anyio.Event()
    stream = burst_then_wait(log, release)
    await stream.__anext__()
    await stream.__anext__()

    async def on_wait() -> None:
        log.entries.append("wait")
        release.set()  # what the producer waits for happens while we flush

    with anyio.fail_after(5):
        assert await next_or_wait(stream.__anext__(), on_wait) == 3
    assert log.entries == ["suspending", "wait"]
    with pytest.raises(StopAsyncIteration):
        await next_or_wait(stream.__anext__(), log.on_wait)
    assert log.closed


#: what on_wait sees per bare checkpoint: on asyncio a checkpoint is a bare yield and not a
#: wait; on trio every suspension counts as one (documented in pipeline/ready.py: merely
#: less coalescing)
CHECKPOINT_WAITS = {"asyncio": [], "trio": ["wait"]}


async def test_a_bare_checkpoint_is_not_a_wait(anyio_backend: str) -> None:
    """A fair producer yields the loop a turn between items; it waits for nothing."""
    ran: list[str] = []

    async def fair() -> AsyncGenerator[int]:
        for i in range(3):
            await checkpoint()
            yield i

    async def other() -> None:
        ran.append("other task")

    log = Log()
    stream = fair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        got = [await next_or_wait(stream.__anext__(), log.on_wait) for _ in range(3)]
    assert got == [0, 1, 2]
    assert ran == ["other task"]  # the checkpoints really gave the loop its turns
    assert log.entries == CHECKPOINT_WAITS[anyio_backend] * 3
    await stream.aclose()


async def test_a_wait_after_checkpoints_runs_on_wait_once() -> None:
    release = anyio.Event()

    async def polite_then_waits() -> AsyncGenerator[int]:
        await checkpoint()
        await checkpoint()
        await release.wait()
        yield 1

    async def on_wait() -> None:
        log.entries.append("wait")
        release.set()

    log = Log()
    stream = polite_then_waits()
    with anyio.fail_after(5):
        assert await next_or_wait(stream.__anext__(), on_wait) == 1
    assert log.entries == ["wait"]
    await stream.aclose()


async def test_cancelled_at_a_checkpoint_reaches_the_producer(anyio_backend: str) -> None:
    seen: list[str] = []
    started = anyio.Event()

    async def spins() -> AsyncGenerator[int]:
        try:
            while True:
                started.set()
                await checkpoint()
        except anyio.get_cancelled_exc_class():
            seen.append("cancelled")
            raise
        yield 0  # pragma: no cover - makes this an async generator

    log = Log()
    stream = spins()

    async def consume() -> None:
        await next_or_wait(stream.__anext__(), log.on_wait)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await started.wait()
            tg.cancel_scope.cancel()
    assert seen == ["cancelled"]
    assert log.entries == CHECKPOINT_WAITS[anyio_backend]
    await stream.aclose()


async def test_on_wait_failing_unwinds_the_producer() -> None:
    log = Log()
    release = anyio.Event()
    stream = burst_then_wait(log, release)
    await stream.__anext__()
    await stream.__anext__()

    async def broken() -> None:
        raise OSError("the socket is gone")

    with anyio.fail_after(5), pytest.raises(OSError, match="socket is gone"):
        await next_or_wait(stream.__anext__(), broken)
    assert log.closed  # the producer's finally ran at its own await point
    await stream.aclose()  # and the generator is not left "already running"


async def test_cancelled_during_on_wait_unwinds_the_producer() -> None:
    log = Log()
    release = anyio.Event()
    stream = burst_then_wait(log, release)
    await stream.__anext__()
    await stream.__anext__()
    flushing = anyio.Event()

    async def slow_flush() -> None:
        flushing.set()
        await anyio.sleep_forever()

    async def consume() -> None:
        await next_or_wait(stream.__anext__(), slow_flush)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await flushing.wait()
            tg.cancel_scope.cancel()
    assert log.closed
    await stream.aclose()


async def test_cancelled_while_the_producer_waits_reaches_the_producer() -> None:
    seen: list[str] = []

    async def waits_forever() -> AsyncGenerator[int]:
        try:
            yield 0
            await anyio.sleep_forever()
            yield 1
        except anyio.get_cancelled_exc_class():
            seen.append("cancelled")
            raise

    stream = waits_forever()
    await stream.__anext__()
    waiting = anyio.Event()

    async def on_wait() -> None:
        waiting.set()

    async def consume() -> None:
        await next_or_wait(stream.__anext__(), on_wait)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await waiting.wait()
            tg.cancel_scope.cancel()
    assert seen == ["cancelled"]
    await stream.aclose()


async def test_producer_errors_propagate_unchanged() -> None:
    async def fails() -> AsyncGenerator[int]:
        await anyio.sleep(0.001)  # a real wait
        raise ValueError("engine fault")
        yield 0  # pragma: no cover - makes this an async generator

    log = Log()
    stream = fails()
    with pytest.raises(ValueError, match="engine fault"):
        await next_or_wait(stream.__anext__(), log.on_wait)
    assert log.entries == ["wait"]
