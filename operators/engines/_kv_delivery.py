"""Delivering KV events produced in another thread to a sink on the event loop, numbered.

An engine's cache changes where its model runs: the llama engine's scheduler thread, the
thread reading vLLM's event socket. A :data:`~pipeline.KvEventSink` is called on the event
loop (the mocker's, an index's, the NATS publisher's), so events are queued by the
producing thread and drained by the loop. :class:`KvDelivery` numbers them as it delivers
them (``seq`` 1, 2, ... from the engine's start) and keeps the set of blocks they describe,
so :meth:`~KvDelivery.snapshot` always equals the events delivered so far, with their last
``seq``: what a consumer that starts late (or saw a gap) replaces its view with. Each tier's
blocks are kept apart (an event's ``tier``; the snapshot's ``tiers`` for the lower ones).

The producer never waits for the loop: a thread that waited for a busy loop would stall
the model (the llama scheduler runs every sequence of a batch). It asks the loop to drain
(``call_soon_threadsafe``, non-blocking) and goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections import deque
from collections.abc import Callable, Hashable, Iterable

from pipeline import DEVICE_TIER, KvEvent, KvEventSink, KvRemoved, KvSnapshot, KvStored

__all__ = ("KvDelivery",)

logger = logging.getLogger("operators.engines")


def _call_soon_threadsafe() -> Callable[[Callable[[], None]], object] | None:
    """How another thread schedules a callback on the running event loop, if any.

    Both are non-blocking (they write a byte to the loop's wake-up pipe). anyio offers only
    blocking calls into the loop from a thread (``anyio.from_thread``).
    """
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token().run_sync_soon  # type: ignore[no-any-return]
        except RuntimeError:
            pass
    return None


class KvDelivery:
    """Delivers KV events queued by any thread to ``sink`` on the event loop, numbered.

    A producing thread calls :meth:`push`; the event loop sets :attr:`sink` (with
    :meth:`set_sink`) and calls :meth:`snapshot`. ``seq`` counts the events delivered: 1,
    2, ... from the engine's start; a snapshot carries the last one (0 before the first).

    No lock: the hand-off is a deque (appends and pops are atomic), and the "drain
    scheduled" flag is a hint; a drain that finds nothing, or one that also takes events
    queued after it was scheduled, is harmless.
    """

    __slots__ = (
        "_call_soon",
        "_draining",
        "_held",
        "_lower",
        "_pending",
        "_scheduled",
        "_seq",
        "sink",
    )

    def __init__(self) -> None:
        self._pending: deque[KvEvent] = deque()  # pushed, not delivered yet
        self._held: dict[Hashable, None] = {}  # as of the events delivered; parents first
        self._lower: dict[str, dict[Hashable, None]] = {}  # the same, per lower tier
        self._seq = 0
        self._draining = False
        self._scheduled = False
        self._call_soon: Callable[[Callable[[], None]], object] | None = None
        #: receives the events on the event loop; None: nothing is tracked
        self.sink: KvEventSink | None = None

    # -------------------------------------------------------------- the event loop

    def set_sink(self, sink: KvEventSink | None) -> None:
        """Report to ``sink`` from now on; None stops tracking (an engine then stops
        producing events). Set it on the event loop that should receive the events."""
        self.sink = sink
        if sink is not None:
            self.bind()

    def bind(self) -> None:
        """Deliver to the running event loop (a sink set outside one is bound by the next
        request); events already waiting are delivered now."""
        call_soon = _call_soon_threadsafe()
        if call_soon is not None:
            self._call_soon = call_soon
        if self._pending:
            self.drain()

    def drain(self) -> None:
        """Number the waiting events, apply them to the snapshot and call the sink.

        Not reentrant: a sink that asks for a snapshot gets the one as of its event.
        """
        self._scheduled = False
        if self._draining:
            return
        self._draining = True
        pending, held = self._pending, self._held
        try:
            while pending:
                event = pending.popleft()
                self._seq += 1
                event = dataclasses.replace(event, seq=self._seq)
                tier = getattr(event, "tier", DEVICE_TIER)
                blocks = held if tier == DEVICE_TIER else self._lower.setdefault(tier, {})
                if isinstance(event, KvStored):
                    blocks.update(dict.fromkeys(event.block_ids))
                elif isinstance(event, KvRemoved):
                    for block in event.block_ids:
                        blocks.pop(block, None)
                else:
                    blocks.clear()
                sink = self.sink
                if sink is not None:
                    try:
                        sink(event)
                    except Exception:  # one failing consumer must not stop the others
                        logger.exception("the KV event sink failed on %r", event)
        finally:
            self._draining = False

    def snapshot(self) -> KvSnapshot:
        """Every block held as of the last event delivered (waiting ones are delivered
        first), parents before children; the lower tiers' (by tier) beside them."""
        self.drain()
        lower = tuple((tier, tuple(blocks)) for tier, blocks in self._lower.items() if blocks)
        return KvSnapshot(tuple(self._held), self._seq, lower)

    # ------------------------------------------------------------ the producing thread

    def push(self, events: Iterable[KvEvent]) -> None:
        """Queue ``events`` (unnumbered, in order) and have the event loop deliver them;
        from any thread, never waiting for the loop."""
        pending = self._pending
        before = len(pending)
        pending.extend(events)
        if len(pending) == before:
            return
        call_soon = self._call_soon
        if self._scheduled or call_soon is None:
            return  # a drain is on its way; or none can be: the next bind() delivers
        self._scheduled = True
        try:
            call_soon(self.drain)
        except Exception:  # the loop is closed: wait for the next bind()
            self._scheduled = False
            self._call_soon = None
