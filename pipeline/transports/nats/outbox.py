"""The worker side of one stream's frames: numbered, parked through an outage, sent again.

:class:`Served` is one request a worker serves, as the wire sees it: its client's inbox,
its frames' sequence, the outputs held for a batch, the credit its client granted.
:class:`Outbox` publishes frames for every stream of a worker and keeps the worker's
counts of what it sent; :class:`~.serving.StreamServer` decides what to send and when.
Frames are described in :mod:`.wire`.

A batch over the server's payload limit is split in halves; an output that cannot be
encoded fails the stream (EngineError) after the outputs before it went out. For a
client that reads wire version 4, a worker given ``coalesce`` merges each batch's outputs
before encoding them (the frame then says how many engine outputs it holds, see
:mod:`.wire`); splitting and the encodable prefix still work on the outputs as the engine
gave them.

Bus outages. While the worker's connection to NATS is down, frames are not handed to
nats-py (whose buffer would flush them the moment the connection is back, before the
client has resubscribed its inbox: lost, and answered "no responders"). Every stream is
*parked* instead: its frames wait, in order, with their sequence numbers, until its client
pings it from its own re-established connection (:meth:`Outbox.resume`). The ping
says which frame the client expects next: the frames lost with the connection are sent
again first (a flow-controlled stream keeps what it sent until the client acknowledges
it, in its CREDIT messages), so the stream resumes with no gap. What waits is bounded by
flow control: no credit arrives meanwhile, so the engine is paused after a window's
worth of outputs. A parked stream whose client never comes back is cut off (see
:class:`~.worker.NatsWorker`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import nats.errors

from pipeline.errors import EngineError

from . import wire
from .wire import BATCH, DATA

if TYPE_CHECKING:
    from nats.aio.client import Client

    from pipeline.context import Context
    from pipeline.transports.codec import Codec

    from .client import Coalesce

__all__ = ("Outbox", "Served")

logger = logging.getLogger(__name__)

_HEARTBEAT_HEADERS: Final = {wire.HEARTBEAT: "1"}


@final
class Served:
    """One request a worker is serving: its reply inbox, sequence and held outputs."""

    __slots__ = (
        "beat",
        "beats_out_of_band",
        "credit",
        "ctx",
        "gone",
        "held",
        "held_since",
        "inbox",
        "kill_early",
        "limit",
        "merging",
        "parked",
        "parked_at",
        "received_ns",
        "reply",
        "resuming",
        "retained",
        "seq",
        "shutdown",
        "stop_early",
        "unparked",
    )

    def __init__(self, inbox: str, reply: str) -> None:
        self.inbox = inbox  # the client's reply inbox: the stream's identity
        self.reply = reply  # where NATS reports "no responders" on that inbox
        self.received_ns = time.time_ns()  # when the request arrived (a traced one's start)
        self.ctx: Context[Any] | None = None
        self.seq = 0  # messages sent
        self.beat = 0  # ``seq`` at the previous heartbeat round
        self.gone = False  # the client no longer reads: send nothing more
        self.shutdown = False  # cut off by a worker shutdown
        self.stop_early = False  # stop/kill arrived before the Context existed
        self.kill_early = False
        self.held: list[Any] = []  # outputs ready but not sent yet
        self.held_since = 0.0  # when the oldest of them was produced (time.monotonic)
        self.limit: float = math.inf  # outputs the client granted in all (flow control)
        self.credit: anyio.Event | None = None  # set when more is granted, while waiting
        self.beats_out_of_band = False  # heartbeats without a sequence number (wire 3)
        self.merging = False  # its batches may be merged (wire 4, and a coalesce function)
        #: (seq, frame) held through a bus outage, in order
        self.parked: list[tuple[int, bytes]] | None = None
        self.parked_at = 0.0  # when it was parked (time.monotonic)
        self.resuming = False  # parked frames are being sent
        #: set when a parking ends: its frames were all sent, or its client is gone
        self.unparked: anyio.Event | None = None
        #: (seq, frame) sent and not acknowledged yet (flow-controlled streams only)
        self.retained: deque[tuple[int, bytes]] | None = None

    def acknowledge(self, next_seq: int) -> None:
        """The client has every frame before ``next_seq``: forget them."""
        retained = self.retained
        while retained and retained[0][0] < next_seq:
            retained.popleft()

    def park(self) -> None:
        """Hold every frame from now on until :meth:`Outbox.resume` (a bus outage)."""
        if self.parked is None and not self.gone:
            self.parked = []
            self.parked_at = time.monotonic()
            self.unparked = anyio.Event()

    def unpark(self) -> None:
        """The parking is over (resumed, or its client is gone)."""
        self.parked = None
        if self.unparked is not None:
            self.unparked.set()

    async def wait_unparked(self) -> None:
        """Return once no frame is parked: a stream that ended in an outage keeps its END
        (and the outputs before it) until its client is back for them or given up."""
        while self.parked is not None and not self.gone and self.unparked is not None:
            await self.unparked.wait()

    def grant(self, total: int) -> None:
        """The client granted ``total`` outputs in all (a CREDIT); stale grants are no-ops."""
        if total > self.limit:
            self.limit = total
            if self.credit is not None:
                self.credit.set()

    def stop(self) -> None:
        if self.ctx is None:
            self.stop_early = True
        else:
            self.ctx.stop_generating()

    def kill(self) -> None:
        if self.ctx is None:
            self.kill_early = True
        else:
            self.ctx.kill()


@final
class Outbox:
    """Publishes the frames of a worker's streams; counts what was sent, and the clients
    that went away."""

    __slots__ = ("clients_gone", "coalesce", "codec", "messages", "nc", "outputs", "worker_id")

    def __init__(self, codec: Codec, worker_id: str, coalesce: Coalesce | None = None) -> None:
        #: the payload codec (requests are decoded with it too)
        self.codec = codec
        #: merges a batch's outputs for clients that read wire version 4 (or None)
        self.coalesce = coalesce
        self.worker_id = worker_id
        #: the worker's connection, set while it serves
        self.nc: Client | None = None
        #: stream messages published (every frame kind)
        self.messages = 0
        #: outputs published (in DATA and BATCH frames)
        self.outputs = 0
        #: requests cut short because the client cancelled or vanished
        self.clients_gone = 0

    def client_gone(self, served: Served) -> None:
        """The client of ``served`` cancelled or vanished: kill it and send nothing more."""
        if not served.gone:
            served.gone = True
            self.clients_gone += 1
            served.kill()
            if served.unparked is not None:
                served.unparked.set()

    async def resume(self, served: Served, next_seq: int | None) -> None:
        """Send what ``served`` held through a bus outage, in order, then stream as before.

        Called when its client pinged it: the client is connected and subscribed again,
        and expects frame ``next_seq`` next (None: a client that does not say). The frames
        from there that were sent and lost go out again first; frames produced meanwhile
        are parked behind the ones being sent.
        """
        frames = served.parked
        if frames is None or served.resuming:
            return
        served.resuming = True
        try:
            if next_seq is not None and served.retained:
                served.acknowledge(next_seq)
                for _, data in list(served.retained):
                    if not await self._publish(served, data):
                        return
            while frames and not served.gone:
                seq, data = frames[0]
                if not await self._publish(served, data):
                    return
                del frames[0]
                if served.retained is not None:
                    served.retained.append((seq, data))
            served.unpark()
        finally:
            served.resuming = False

    async def _publish(self, served: Served, data: bytes) -> bool:
        """Publish one frame of ``served``; False (and the client is gone) when it fails."""
        nc = self.nc
        if nc is None or served.gone:
            return False
        try:
            await nc.publish(served.inbox, data, reply=served.reply)
        except nats.errors.Error as exc:
            logger.warning("worker %s cannot reach its client: %r", self.worker_id, exc)
            self.client_gone(served)
            return False
        return True

    async def heartbeat(self, served: Served) -> None:
        """Tell a quiet stream's client that the worker is alive (and learn if it is not)."""
        nc = self.nc
        if served.parked is not None:
            return  # its client will ping it once it is back
        if not served.beats_out_of_band:
            await self.send(served, wire.HB, None)
        elif not served.gone and nc is not None:
            self.messages += 1
            try:
                # Published with the reply subject like a frame: a vanished client is
                # noticed by its "no responders" (NatsWorker._on_gone).
                await nc.publish(served.inbox, b"", reply=served.reply, headers=_HEARTBEAT_HEADERS)
            except nats.errors.Error as exc:
                logger.warning("worker %s cannot reach its client: %r", self.worker_id, exc)
                self.client_gone(served)

    async def flush(self, served: Served) -> None:
        """Send the outputs ``served`` holds, in one message."""
        if served.held:
            items = served.held.copy()
            served.held.clear()
            await self._send_outputs(served, items)

    async def _send_outputs(self, served: Served, items: list[Any]) -> None:
        if len(items) == 1:
            await self.send(served, DATA, items[0])
        else:
            await self.send(served, BATCH, items)

    async def send(self, served: Served, kind: int, body: Any) -> None:
        """Publish one frame; a client that is gone (or unreachable) gets nothing more.

        Raises:
            EngineError: when an output cannot be encoded or is too large for NATS.
        """
        nc = self.nc
        if served.gone or nc is None:
            return
        try:
            frame = [served.seq, kind, body]
            if kind == BATCH and served.merging and self.coalesce is not None:
                merged = self.coalesce(body)
                if len(merged) < len(body):
                    frame = [served.seq, kind, merged, len(body)]
            data = self.codec.encode(frame)
        except Exception as exc:
            if kind == BATCH:
                await self._send_encodable_prefix(served, body)
            raise EngineError(
                f"worker {self.worker_id} cannot encode a {type(body).__name__} output: {exc}"
            ) from exc
        outputs = 1 if kind == DATA else len(body) if kind == BATCH else 0
        if served.parked is not None or not nc.is_connected:
            if len(data) > nc.max_payload:
                await self._too_large(served, kind, body, len(data))
                return
            served.park()
            if served.parked is not None:
                served.parked.append((served.seq, data))
                served.seq += 1
                self.messages += 1
                self.outputs += outputs
            return
        # Counted before the publish, which may suspend: the client can have the message
        # before this task runs again.
        seq = served.seq
        served.seq += 1
        self.messages += 1
        self.outputs += outputs
        if served.retained is not None:
            served.retained.append((seq, data))
        try:
            # The reply subject is how a vanished client is noticed: NATS answers a publish
            # nobody receives with "no responders" there (NatsWorker._on_gone).
            await nc.publish(served.inbox, data, reply=served.reply)
        except nats.errors.MaxPayloadError:
            if served.retained:
                served.retained.pop()
            # Nothing was sent (the size is checked before anything is queued, so nothing
            # else could send meanwhile either).
            served.seq -= 1
            self.messages -= 1
            self.outputs -= outputs
            await self._too_large(served, kind, body, len(data))
        except nats.errors.Error as exc:
            logger.warning("worker %s cannot reach its client: %r", self.worker_id, exc)
            self.client_gone(served)

    async def _too_large(self, served: Served, kind: int, body: Any, size: int) -> None:
        """A frame over the server's payload limit: a batch goes out in halves.

        Raises:
            EngineError: for one output that is too large on its own.
        """
        if kind == BATCH:
            half = len(body) // 2
            await self._send_outputs(served, body[:half])
            await self._send_outputs(served, body[half:])
            return
        raise EngineError(f"a {type(body).__name__} output of {size} bytes is over the NATS limit")

    async def _send_encodable_prefix(self, served: Served, items: list[Any]) -> None:
        """A batch failed to encode: send the outputs before the first bad one, then raise.

        Raises:
            EngineError: naming the output that cannot be encoded.
        """
        for index, item in enumerate(items):
            try:
                self.codec.encode(item)
            except Exception as exc:
                if index:
                    await self._send_outputs(served, items[:index])
                raise EngineError(
                    f"worker {self.worker_id} cannot encode a {type(item).__name__} output: {exc}"
                ) from exc
