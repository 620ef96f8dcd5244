"""Connecting ``serve --nats`` and ``worker`` to NATS, and keeping nats-py's logs short.

Failures to connect are the user's to fix (a wrong URL, no server yet), so they are one
line on stderr and an exit code, never a traceback.

KV events cross NATS here too: a worker publishes its engine's (:func:`publish_kv_events`),
a ``serve --router kv`` frontend follows them into one index per worker set
(:func:`follow_kv_events`), with the load reports the workers send along, which a planner
reads too (:func:`publish_load`: a worker's one source of load reports).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio

from pipeline import PrefixIndex, Worker, WorkerLoad

from .defaults import NATS_CONNECT_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import Iterable

    from anyio.abc import TaskGroup
    from nats.aio.client import Client

    from operators.contracts.transport import RequestLog
    from operators.edges.http.metrics import ServerMetrics
    from pipeline import WorkerSet

__all__ = (
    "KvFeed",
    "OneLineErrors",
    "close_nats",
    "connect_nats",
    "follow_kv_events",
    "follow_planner",
    "one_line",
    "publish_kv_events",
    "publish_load",
)

logger = logging.getLogger(__name__)


async def connect_nats(url: str, *, name: str) -> Client | None:
    """A NATS client that reconnects forever once connected; None (said on stderr) when no
    server accepted the connection at ``url`` within :data:`NATS_CONNECT_TIMEOUT` seconds.
    """
    from pipeline import ConnectFailed
    from pipeline.transports.nats import connect

    try:
        return await connect(url, name=name, give_up_after=NATS_CONNECT_TIMEOUT)
    except ConnectFailed as exc:
        print(f"llm-pipeline: {exc}", file=sys.stderr)
        return None


def one_line(exc: BaseException) -> str:
    """What went wrong, in one line: the leaves of an exception group, not the group."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(one_line(inner) for inner in exc.exceptions)
    return " ".join(str(exc).split()) or type(exc).__name__


async def close_nats(nc: Client) -> None:
    """Close ``nc`` (shielded, at most 2 s: a server that went away must not hang exit)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
        try:
            await nc.close()
        except Exception as exc:  # closing a connection to a server that went away
            logger.debug("closing the NATS connection: %r", exc)


async def publish_kv_events(
    task_group: TaskGroup, nc: Client, engine: Any, *, model: str, worker_id: str
) -> bool:
    """Publish ``engine``'s KV events for ``model`` from ``task_group``, if it reports any
    (a mocker with a cache, the llama engine); start before the worker registers, so that
    frontends can ask for its snapshot as soon as they see it. False: it reports none."""
    from pipeline.transports.nats import NatsKvPublisher

    if not hasattr(engine, "kv_snapshot"):
        return False
    publisher = NatsKvPublisher(engine, nc=nc, model=model, worker_id=worker_id)
    await task_group.start(publisher.run)
    return publisher.active


async def publish_load(
    task_group: TaskGroup, nc: Client, log: RequestLog, engine: Any, *, model: str, worker_id: str
) -> None:
    """Tell the worker's load from ``task_group``: the engine's own report when it makes one
    (``load_report()``: exact), else what ``log`` (the worker's request log) counts; start
    before the worker registers.

    One source, one publisher per message: an engine that reports its load and KV events
    has its reports ride along the KV events already (:func:`publish_kv_events`), so the
    :class:`~pipeline.transports.nats.NatsLoadPublisher` here only answers a planner that
    asks; otherwise it also publishes whenever ``log`` sees the load change (a frontend's
    KV router and a planner read either the same way, :class:`pipeline.WorkerLoad`).
    """
    from pipeline.transports.nats import NatsLoadPublisher

    report = getattr(engine, "load_report", None)

    def load() -> dict[str, Any]:
        now = report() if callable(report) else None
        return now.to_dict() if isinstance(now, WorkerLoad) else log.load()

    publisher = NatsLoadPublisher(nc, model=model, worker_id=worker_id, load=load)
    rides_along = callable(report) and hasattr(engine, "kv_snapshot")  # see NatsKvPublisher
    if not rides_along:
        log.on_change = publisher.changed
    await task_group.start(publisher.run)


async def follow_planner(
    stack: contextlib.AsyncExitStack, nc: Client, metrics: ServerMetrics
) -> Callable[[], dict[str, Any] | None]:
    """A ``serve --nats`` frontend's part in planning, until ``stack`` unwinds: publish what
    its latency histograms gain (``llm-pipeline planner`` reads them), and follow the
    planner's status; returns what shows it (None: no planner spoke lately)."""
    from operators.planner.latency import LatencyReporter
    from operators.planner.status import PlannerWatch
    from pipeline.transports.nats import DEFAULT_NAMESPACE

    tg = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(tg.cancel_scope.cancel)
    reporter = LatencyReporter(
        nc, metrics, namespace=DEFAULT_NAMESPACE, frontend=f"serve-{os.getpid()}"
    )
    tg.start_soon(reporter.run)
    watch = PlannerWatch(nc, namespace=DEFAULT_NAMESPACE)
    await tg.start(watch.run)
    return watch.last


class KvFeed(NamedTuple):
    """What the KV router of one worker set reads, fed over NATS."""

    #: the blocks each member holds (its KV events)
    prefixes: PrefixIndex
    #: each member's last load report (None: none heard)
    report: Callable[[Worker[Any, Any]], WorkerLoad | None]


async def follow_kv_events(
    task_group: TaskGroup, nc: Client, *, model: str, sets: Iterable[WorkerSet[Any, Any]]
) -> list[KvFeed]:
    """One index per worker set, fed from ``task_group`` by the KV events its members
    publish, and their load reports (see :class:`~pipeline.transports.nats.NatsKvEvents`);
    returns once every current member was asked for its snapshot."""
    from pipeline.transports.nats import NatsKvEvents

    feeds = []
    for workers in sets:
        index = PrefixIndex()
        events = NatsKvEvents(nc, model=model, index=index)
        await task_group.start(events.run, workers)
        feeds.append(KvFeed(index, events.load_report))
    return feeds


class OneLineErrors(logging.Filter):
    """Turns nats-py's "encountered error" tracebacks (one per failed reconnection attempt
    while the server is away) into one-line warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]!r}"
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True
