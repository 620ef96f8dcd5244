"""Engines across processes over NATS: a worker side, a client side, and discovery.

::

    frontend process                                   worker process
    Router(WorkerSet) --> RemoteEngine --request-->  NatsWorker --> open_stream(engine, ctx)
                      <-- frames on a reply inbox <--
    NatsDiscovery <--- KV bucket (one key per worker, TTL) <--- registration, refreshed

* :func:`serve` / :class:`NatsWorker` expose any Engine: requests arrive on the model's
  queue-group subject (load-balanced) and on the worker's own subject (direct routing);
  each gets its Context rebuilt (id, payload, deadline, metadata) and is streamed back as
  frames ``[seq, kind, body]`` (START, DATA, BATCH, END, ERR, HB; see :mod:`.wire`). Outputs
  the engine has ready together share one BATCH message; the worker sends what it holds
  the moment the engine would wait (see :mod:`.serving`), merged into fewer outputs when
  it was given ``coalesce`` (the LLM layer merges token outputs into bursts). It sends at
  most the credit its client granted (flow control), and a stream it cuts off (a drain
  that ran out or was cut short) ends with an ERR frame, so its client migrates it at
  once.
* :class:`RemoteEngine` is the client half, an Engine like any other. Errors raised by the
  remote engine come back as the same :mod:`pipeline.errors` type; transport failures
  become :class:`~pipeline.WorkerLost` (``ConnectFailed`` before the stream started,
  ``StreamDisconnected`` after, ``ResponseTimeout`` when the worker stops answering), so
  Migration retries them elsewhere.
* :class:`NatsDiscovery` follows a JetStream KV bucket and keeps a
  :class:`~pipeline.WorkerSet` current: workers appear when they register, leave when they
  stop gracefully, are evicted at the first "no responders" for them, and are declared
  lost (their in-flight streams fail) when their key's TTL runs out.
* KV events, for KV-aware routing: :class:`NatsKvPublisher` publishes what an engine that
  reports its prefix cache (a :class:`KvReporter`) stores and evicts, on
  ``{ns}.kv.{model}.{worker_id}``, and answers snapshot requests on that subject plus
  ``.snapshot``; :class:`NatsKvEvents` keeps a frontend's
  :class:`~pipeline.prefix_index.PrefixIndex` current for a WorkerSet's members. Plain
  subscriptions, so every frontend keeps its own index; nothing is persisted: a worker
  that joins, a gap in a worker's event numbers, and a reconnection each get a snapshot,
  and a worker that leaves the set (stopped, evicted at "no responders", expired) has its
  blocks dropped at once (:meth:`~pipeline.WorkerSet.listen`), long before its key would
  expire.
* :class:`NatsModels` follows which models workers register for at all, for a frontend
  that serves every model its workers serve (one NatsDiscovery per model then).
* For a planner: :class:`NatsLoadPublisher` publishes a worker's load when it changes (on
  its KV events subject, as a ``load`` field), :class:`NatsLoads` follows every worker's,
  and :func:`drain_worker` asks a worker to drain as SIGTERM would (``[DRAIN]`` on its
  control subject): it leaves discovery at once, finishes what it serves within its
  drain timeout, and cuts off the rest for Migration to continue elsewhere.
* :func:`connect` makes the connection workers and frontends use: reconnecting forever
  once connected, :class:`~pipeline.ConnectFailed` when the first connection does not
  succeed within ``give_up_after`` seconds. An outage of the bus is ridden out: while a
  process's own connection is down it judges no peer, streams wait (up to
  ``NatsTimeouts.outage``, never past their deadline), workers hold their frames, and once
  the bus is back each stream resumes where it stopped (frames lost with the connection
  are sent again); see :mod:`.bus`. :class:`JetStreamUnavailable` says at start that
  discovery's bucket cannot be used.

Cancellation travels both ways. The client's stop and kill are control messages to the
worker's control subject. A client that vanished is noticed by the worker on its next
frame: frames are published with a reply subject, so NATS answers "no responders" when
nobody listens on the client's inbox any more; idle streams get heartbeats, so that also
happens while the engine is silent or the stream waits for credit. A worker that
vanished is noticed by the client when a stream goes quiet: it pings the worker's control
subject, and a dead worker has no responders (a slow one answers, so a long prefill is
never mistaken for a death).

A worker process and a frontend, in full::

    async with anyio.create_task_group() as tg:                 # the worker
        worker = await tg.start(serve(engine, url=URL, model="smollm2", codec=CODEC).run)
        ...                                                     # worker.stop() on SIGTERM

    nc = await connect(URL)                                     # the frontend
    workers = WorkerSet("smollm2")
    async with NatsDiscovery(nc, model="smollm2", codec=CODEC).watch(workers):
        graph = link(Migration(), Backend(tokenizer), Router(workers))

With KV-aware routing, the worker also starts ``await tg.start(NatsKvPublisher(engine,
nc=nc, model="smollm2", worker_id=ID).run)`` before it registers, and the frontend
``await tg.start(NatsKvEvents(nc, model="smollm2", index=index).run, workers)`` for the
``KvRouter(index, ...)`` policy of its Router.

``RemoteEngine(nc, model="smollm2")`` skips discovery: NATS load-balances over the queue
group. The codec must carry the payload types
(:class:`~pipeline.transports.codec.DataclassCodec`). The Context's state store does not
travel: operators that keep state (the Backend) run on the frontend, in front of the
remote engine.

nats-py is asyncio-only; these modules are the one place that knows. Their callbacks only
hand messages to a stream's buffer or start tasks in the worker's task group, and the
client's idle timer is one event-loop timer per engine (not a task or a cancel scope per
stream), so nothing outlives its owner and nothing is held across a ``yield``. Needs
nats-server >= 2.11 (per-message TTLs) with JetStream for discovery.

This module is the package's public face; its modules are internal, one part each:
:mod:`.wire` (subjects, frames, error bodies, timeouts), :mod:`.connection` and
:mod:`.bus` (the connection, and what a process knows of it), :mod:`.client` and
:mod:`.inbox` (the client half), :mod:`.worker`, :mod:`.serving`, :mod:`.outbox` and
:mod:`.keeper` (the worker half), :mod:`.registration`, :mod:`.bucket` (opening the
discovery bucket), :mod:`.watch` (following it: one watch per connection),
:mod:`.discovery`, :mod:`.models`, :mod:`.kv`, :mod:`.load` and :mod:`.drain`.
"""

from __future__ import annotations

from .bucket import DEFAULT_BUCKET as DEFAULT_BUCKET
from .bucket import JetStreamUnavailable as JetStreamUnavailable
from .client import RemoteEngine as RemoteEngine
from .client import RemoteEngineStatistics as RemoteEngineStatistics
from .connection import CONNECT_TIMEOUT as CONNECT_TIMEOUT
from .connection import connect as connect
from .discovery import NatsDiscovery as NatsDiscovery
from .drain import drain_worker as drain_worker
from .kv import KvReporter as KvReporter
from .kv import NatsKvEvents as NatsKvEvents
from .kv import NatsKvEventsStatistics as NatsKvEventsStatistics
from .kv import NatsKvPublisher as NatsKvPublisher
from .kv import NatsKvPublisherStatistics as NatsKvPublisherStatistics
from .kv import kv_subject as kv_subject
from .load import LOAD_EVERY as LOAD_EVERY
from .load import NatsLoadPublisher as NatsLoadPublisher
from .load import NatsLoads as NatsLoads
from .models import NatsModels as NatsModels
from .wire import DEFAULT_NAMESPACE as DEFAULT_NAMESPACE
from .wire import DEFAULT_WINDOW as DEFAULT_WINDOW
from .wire import ROLES as ROLES
from .wire import NatsTimeouts as NatsTimeouts
from .worker import NatsWorker as NatsWorker
from .worker import NatsWorkerStatistics as NatsWorkerStatistics
from .worker import serve as serve

__all__ = (
    "CONNECT_TIMEOUT",
    "DEFAULT_BUCKET",
    "DEFAULT_NAMESPACE",
    "DEFAULT_WINDOW",
    "LOAD_EVERY",
    "ROLES",
    "JetStreamUnavailable",
    "KvReporter",
    "NatsDiscovery",
    "NatsKvEvents",
    "NatsKvEventsStatistics",
    "NatsKvPublisher",
    "NatsKvPublisherStatistics",
    "NatsLoadPublisher",
    "NatsLoads",
    "NatsModels",
    "NatsTimeouts",
    "NatsWorker",
    "NatsWorkerStatistics",
    "RemoteEngine",
    "RemoteEngineStatistics",
    "connect",
    "drain_worker",
    "kv_subject",
    "serve",
)
