"""The discovery bucket's watch loop, :func:`watch_bucket`, against a real nats-server.

Discovery and the model list are its followers (their own behaviour is tested in
``test_nats.py`` and ``tests/operators/cli/test_cli_nats_models.py``); here, what it promises
them: the replay between ``on_watch`` and ``on_replayed``, ``task_status`` after it, a
renewed watch (and a new replay) after the server restarts, and a clean stop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import anyio
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from nats.aio.client import Client
from nats.js.kv import KeyValue

from pipeline.transports.nats import JetStreamUnavailable
from pipeline.transports.nats.bucket import open_bucket, watch_bucket
from tests.helpers.nats_server import NatsServer, connect, settle

pytestmark = pytest.mark.slow  # every test starts a nats-server

BUCKET = "test-bucket"
WATCH = ("watch",)
REPLAYED = ("replayed",)


class Log:
    """What the watch told, in order; a test waits for what it expects next."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.polls = 0
        self._changed = anyio.Event()

    def _add(self, *event: Any) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = anyio.Event()

    def on_watch(self) -> None:
        self._add(*WATCH)

    def on_entry(self, entry: KeyValue.Entry) -> None:
        self._add("entry", entry.key, entry.operation, entry.value or None)

    def on_replayed(self) -> None:
        self._add(*REPLAYED)

    def on_poll(self) -> None:
        self.polls += 1
        self._changed.set()
        self._changed = anyio.Event()

    def watching(self, nc: Client, keys: str = ">") -> Callable[..., Any]:
        """``watch_bucket`` with every callback, for ``task_group.start``."""
        return functools.partial(
            watch_bucket,
            nc,
            BUCKET,
            keys,
            self.on_entry,
            on_watch=self.on_watch,
            on_replayed=self.on_replayed,
            on_poll=self.on_poll,
            name="test",
        )

    async def wait_until(self, condition: Callable[[], bool], within: float = 5.0) -> None:
        with anyio.fail_after(within):
            while not condition():
                await self._changed.wait()


def put(key: str, value: str) -> tuple[str, None, bytes]:
    return ("entry", key, None, value.encode())


async def bucket(nc: Client) -> KeyValue:
    return await open_bucket(nc.jetstream(), BUCKET, nc=nc)


async def test_the_replay_is_told_between_on_watch_and_on_replayed_then_started(
    nc: Client, worker_nc: Client
) -> None:
    kv = await bucket(worker_nc)
    await kv.put("a.1", b"one")
    await kv.put("a.2", b"two")
    await kv.delete("a.2")
    await kv.put("b.1", b"other")
    log = Log()
    async with anyio.create_task_group() as tg:
        await tg.start(log.watching(nc, "a.*"))
        # Started: the bucket as it stands was told, markers included, other keys not.
        assert log.events == [WATCH, put("a.1", "one"), ("entry", "a.2", "DEL", None), REPLAYED]

        await kv.put("b.2", b"not watched")
        await kv.put("a.3", b"three")
        await log.wait_until(lambda: len(log.events) == 5)
        assert log.events[4:] == [put("a.3", "three")]
        tg.cancel_scope.cancel()


async def test_an_empty_bucket_replays_nothing_and_the_watch_starts(nc: Client) -> None:
    log = Log()
    async with anyio.create_task_group() as tg:
        await tg.start(log.watching(nc))
        assert log.events == [WATCH, REPLAYED]
        tg.cancel_scope.cancel()


async def test_on_poll_is_called_while_nothing_arrives(nc: Client) -> None:
    log = Log()
    async with anyio.create_task_group() as tg:
        await tg.start(log.watching(nc))
        polls = log.polls
        await log.wait_until(lambda: log.polls >= polls + 3, within=3.0)  # 0.25 s apart
        assert log.events == [WATCH, REPLAYED]
        tg.cancel_scope.cancel()


@pytest.mark.time_limit(30)
async def test_a_server_restart_renews_the_watch_which_replays_the_bucket_again(
    nats_server: NatsServer, nc: Client, worker_nc: Client
) -> None:
    kv = await bucket(worker_nc)
    await kv.put("a.1", b"one")
    log = Log()
    async with anyio.create_task_group() as tg:
        await tg.start(log.watching(nc))
        assert log.events == [WATCH, put("a.1", "one"), REPLAYED]

        await anyio.to_thread.run_sync(nats_server.restart)
        await log.wait_until(lambda: log.events.count(REPLAYED) == 2, within=10.0)
        assert log.events[3:] == [WATCH, put("a.1", "one"), REPLAYED]

        # The renewed watch tells what changes after it.
        with anyio.fail_after(10.0):
            while True:  # JetStream may still be recovering on the restarted server
                try:
                    await (await bucket(worker_nc)).put("a.2", b"two")
                    break
                except Exception:
                    await anyio.sleep(0.1)
        await log.wait_until(lambda: len(log.events) == 7)
        assert log.events[6:] == [put("a.2", "two")]
        tg.cancel_scope.cancel()


async def test_cancelling_the_watch_stops_it(nc: Client, worker_nc: Client) -> None:
    kv = await bucket(worker_nc)
    log = Log()
    with anyio.fail_after(3.0):  # the stop is bounded even when the server is slow
        async with anyio.create_task_group() as tg:
            await tg.start(log.watching(nc))
            before = nc.stats["in_msgs"]
            await kv.put("a.1", b"one")
            await log.wait_until(lambda: len(log.events) == 3)
            assert nc.stats["in_msgs"] > before  # the watch's messages come to nc
            tg.cancel_scope.cancel()
    await settle(nc)  # the server has processed what nc sent: the unsubscription too
    reference = await kv.watch("a.2")  # another client's watch, to know when a.2 went out
    assert await reference.updates() is None  # its (empty) replay
    before = nc.stats["in_msgs"]
    await kv.put("a.2", b"two")
    entry = await reference.updates()
    assert entry is not None
    assert entry.value == b"two"
    await settle(nc)  # anything the server sent nc before this round trip is in
    assert nc.stats["in_msgs"] == before + 1  # settle's own message: no entry came
    assert log.events == [WATCH, REPLAYED, put("a.1", "one")]
    await reference.stop()  # type: ignore[no-untyped-call]


async def test_a_watch_whose_connection_closed_still_stops_cleanly(
    nats_server: NatsServer,
) -> None:
    closing = await connect(nats_server)
    log = Log()
    with anyio.fail_after(3.0):
        async with anyio.create_task_group() as tg:
            await tg.start(log.watching(closing))
            await closing.close()
            polls = log.polls
            await log.wait_until(lambda: log.polls > polls)  # it goes on, quietly
            tg.cancel_scope.cancel()  # stopping the watch fails: logged, not raised
    assert log.events == [WATCH, REPLAYED]


async def test_a_bucket_that_cannot_be_watched_at_first_is_jetstream_unavailable(
    nats_server: NatsServer,
) -> None:
    closed = await connect(nats_server)
    await closed.close()
    log = Log()
    with pytest.raises(
        JetStreamUnavailable, match=f"cannot open the JetStream KV bucket '{BUCKET}'"
    ):
        await log.watching(closed)()
    assert log.events == []
