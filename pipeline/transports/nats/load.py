"""A worker's load, told over NATS: :class:`NatsLoadPublisher` and :class:`NatsLoads`.

A planner sizes a pool by the work its workers hold, and the workers know it. The report
rides on the worker's KV events subject (:mod:`.kv`), as a ``load`` field beside (no)
events, so a frontend that follows KV events reads it in the same stream and one that
does not pays nothing::

    {ns}.kv.{model}.{worker_id}         {"worker": ID, "events": [], "load": {name: number}}
    {ns}.kv.{model}.{worker_id}.load    request/reply: the same message, now

The load is whatever numbers the worker's caller reports (the LLM layer sends requests
``waiting`` and ``decoding`` and ``prefill`` tokens queued). It is published when it
changes, at most once per ``every`` seconds (the last change always goes out), and never
while it does not: an idle worker sends nothing. A planner that has not heard from a
worker (it started later, or a message was lost) asks (:meth:`NatsLoads.ask`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import nats.errors
from anyio.abc import TaskStatus

from . import wire
from .connection import quietly, settle
from .kv import kv_subject
from .wire import DEFAULT_NAMESPACE, control_codec

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ("LOAD_EVERY", "NatsLoadPublisher", "NatsLoads")

logger = logging.getLogger(__name__)

#: seconds at least between two load reports of one worker
LOAD_EVERY: Final = 0.5

Load = Mapping[str, Any]


@final
class NatsLoadPublisher:
    """Publishes ``load()`` for worker ``worker_id`` of ``model`` whenever :meth:`changed`
    says it changed (at most once per ``every`` seconds), and answers when asked.

    Start it before the worker registers, so that a planner that hears of the worker can
    ask at once: ``await task_group.start(publisher.run)``. :meth:`changed` is cheap and
    synchronous: call it on the request path.
    """

    def __init__(
        self,
        nc: Client,
        *,
        model: str,
        worker_id: str,
        load: Callable[[], Load],
        namespace: str = DEFAULT_NAMESPACE,
        every: float = LOAD_EVERY,
    ) -> None:
        self.worker_id = worker_id
        #: where the reports go
        self.subject = kv_subject(model, worker_id, namespace)
        self._nc = nc
        self._load = load
        self._every = every
        self._changed = anyio.Event()
        self._said: dict[str, Any] | None = None
        #: reports published, and answers to requests
        self.published = self.answered = 0

    def changed(self) -> None:
        """The load changed: a report goes out within ``every`` seconds."""
        self._changed.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Publish until cancelled; ``task_status`` is told once requests are answered."""
        subscription = await self._nc.subscribe(f"{self.subject}.load", cb=self._on_request)
        try:
            await settle(self._nc)
            task_status.started()
            while True:
                await self._changed.wait()
                self._changed = anyio.Event()
                load = dict(self._load())
                if load != self._said:
                    self._said = load
                    await self._publish(self.subject, load)
                    self.published += 1
                await anyio.sleep(self._every)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await quietly(subscription.unsubscribe)

    async def _publish(self, subject: str, load: Load) -> None:
        data = control_codec.encode({"worker": self.worker_id, "events": [], "load": load})
        try:
            await self._nc.publish(subject, data)
        except nats.errors.Error as exc:  # a closed or draining connection: next time
            logger.debug("worker %s: load report not sent: %r", self.worker_id, exc)

    async def _on_request(self, msg: Msg) -> None:
        if msg.reply:
            self.answered += 1
            await self._publish(msg.reply, dict(self._load()))

    def __repr__(self) -> str:
        return f"NatsLoadPublisher({self.worker_id!r}, {self.subject!r})"


@final
class NatsLoads:
    """Follows the load reports of every worker in ``namespace``: each one heard is given
    to ``on_report(worker_id, load)`` (KV events without a load are skipped).

    ``await task_group.start(loads.run)``; :meth:`ask` a worker whose report you lack.
    """

    def __init__(
        self,
        nc: Client,
        on_report: Callable[[str, Load], None],
        *,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        wire.Subjects(namespace)  # checks the namespace
        self._nc = nc
        self._on_report = on_report
        self._namespace = namespace
        #: reports heard (published and asked for)
        self.reports = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow until cancelled; ``task_status`` is told once subscribed."""
        subject = f"{self._namespace}.kv.*.*"
        subscription = await self._nc.subscribe(subject, cb=self._on_message)
        try:
            await settle(self._nc)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await quietly(subscription.unsubscribe)

    async def ask(self, model: str, worker_id: str, *, within: float = 1.0) -> bool:
        """Ask ``worker_id`` (of ``model``) for its load now; True when it answered (its
        report went to ``on_report``)."""
        subject = f"{kv_subject(model, worker_id, self._namespace)}.load"
        try:
            reply = await self._nc.request(subject, b"", timeout=within)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return False
        return self._heard(reply.data)

    async def _on_message(self, msg: Msg) -> None:
        self._heard(msg.data)

    def _heard(self, data: bytes) -> bool:
        try:
            body = control_codec.decode(data)
            load = body.get("load") if isinstance(body, dict) else None
            if load is None:
                return False  # KV events alone
            worker_id = str(body["worker"])
            if not isinstance(load, dict):
                raise TypeError(f"a load of type {type(load).__name__}")
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("a malformed load report: %r", exc)
            return False
        self.reports += 1
        self._on_report(worker_id, load)
        return True

    def __repr__(self) -> str:
        return f"NatsLoads({self._namespace!r})"
