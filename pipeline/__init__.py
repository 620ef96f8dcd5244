"""llm-pipeline's engine-agnostic core: requests flow forward through operators to an engine.

The parts:

- :class:`Context` — one request: payload, id, typed :class:`State`, stop/kill, deadline.
- :class:`Engine` and :class:`Operator` — the two Protocols; :func:`link` composes them
  (:func:`chain` groups same-typed operators);
  :class:`Stream` — what their ``generate`` returns (async iteration + ``aclose``).
- :func:`open_stream` — the driver that owns cancellation; :class:`FunctionEngine`.
- :func:`next_or_wait` — await a stream's next item, flushing first if it would wait.
- :mod:`pipeline.routers` — Engines that pick a worker per request from a WorkerSet;
  :class:`KvRouter` (:mod:`pipeline.kv_routing`) is the policy that prefers the worker
  caching a request's prefix, per a :class:`PrefixIndex` fed by KV events
  (:mod:`pipeline.prefix_index`), weighing each worker's load in prompt tokens
  (:class:`WorkerLoad`, what it reports; :class:`LoadLedger`, what this router sent it:
  :mod:`pipeline.worker_load`) and keeping named conversations on their worker
  (:class:`Affinity`).
- :mod:`pipeline.priority` — who goes first among waiting requests (priority, then
  arrival, with aging), for every queue that admits requests.
- :mod:`pipeline.kv_tier` — :class:`KvTier`: where an engine keeps KV blocks evicted from
  its working cache (:class:`MemoryKvTier`, :class:`DiskKvTier`), by block id.
- :mod:`pipeline.errors` — the one exception hierarchy (re-exported here).
- :mod:`pipeline.testing` — test doubles and the ``check_operator`` conformance suite.
- :mod:`pipeline.tracing` — spans per request and stage (``ctx.span``), started by an edge's
  :class:`~pipeline.tracing.Tracer`; :func:`link` gives every linked operator its own
  (:func:`named` names a stage's).

This package knows nothing about LLMs: it imports no pydantic, no tokenizers and nothing
from ``operators``.
"""

from __future__ import annotations

from .affinity import Affinity as Affinity
from .context import Context as Context
from .context import State as State
from .context import StateKey as StateKey
from .context import StateKeyError as StateKeyError
from .errors import CapacityExhausted as CapacityExhausted
from .errors import ConnectFailed as ConnectFailed
from .errors import EngineDead as EngineDead
from .errors import EngineError as EngineError
from .errors import EngineStalled as EngineStalled
from .errors import EngineUnavailable as EngineUnavailable
from .errors import InvalidRequest as InvalidRequest
from .errors import LinkError as LinkError
from .errors import PipelineError as PipelineError
from .errors import RequestError as RequestError
from .errors import ResponseTimeout as ResponseTimeout
from .errors import StreamDisconnected as StreamDisconnected
from .errors import WorkerLost as WorkerLost
from .kv_events import DEVICE_TIER as DEVICE_TIER
from .kv_events import KvCleared as KvCleared
from .kv_events import KvEvent as KvEvent
from .kv_events import KvEventSink as KvEventSink
from .kv_events import KvRemoved as KvRemoved
from .kv_events import KvSnapshot as KvSnapshot
from .kv_events import KvStored as KvStored
from .kv_events import event_from_dict as event_from_dict
from .kv_routing import KvRouter as KvRouter
from .kv_tier import DISK_TIER as DISK_TIER
from .kv_tier import HOST_TIER as HOST_TIER
from .kv_tier import DiskKvTier as DiskKvTier
from .kv_tier import KvTier as KvTier
from .kv_tier import MemoryKvTier as MemoryKvTier
from .link import chain as chain
from .link import link as link
from .link import named as named
from .operator import Engine as Engine
from .operator import Operator as Operator
from .operator import Stream as Stream
from .prefix_index import PrefixIndex as PrefixIndex
from .ready import next_or_wait as next_or_wait
from .routers import Direct as Direct
from .routers import LeastLoaded as LeastLoaded
from .routers import MemoryDiscovery as MemoryDiscovery
from .routers import Random as Random
from .routers import RoundRobin as RoundRobin
from .routers import Router as Router
from .routers import RoutingPolicy as RoutingPolicy
from .routers import Worker as Worker
from .routers import WorkerSet as WorkerSet
from .routers import WorkerSetStatistics as WorkerSetStatistics
from .streams import FunctionEngine as FunctionEngine
from .streams import open_stream as open_stream
from .worker_load import LoadLedger as LoadLedger
from .worker_load import WorkerLoad as WorkerLoad

__all__ = (
    "Affinity",
    "CapacityExhausted",
    "ConnectFailed",
    "Context",
    "DEVICE_TIER",
    "DISK_TIER",
    "Direct",
    "DiskKvTier",
    "Engine",
    "EngineDead",
    "EngineError",
    "EngineStalled",
    "EngineUnavailable",
    "FunctionEngine",
    "HOST_TIER",
    "InvalidRequest",
    "KvCleared",
    "KvEvent",
    "KvEventSink",
    "KvRemoved",
    "KvRouter",
    "KvSnapshot",
    "KvStored",
    "KvTier",
    "LeastLoaded",
    "LinkError",
    "LoadLedger",
    "MemoryDiscovery",
    "MemoryKvTier",
    "Operator",
    "PipelineError",
    "PrefixIndex",
    "Random",
    "RequestError",
    "ResponseTimeout",
    "RoundRobin",
    "Router",
    "RoutingPolicy",
    "State",
    "StateKey",
    "StateKeyError",
    "Stream",
    "StreamDisconnected",
    "Worker",
    "WorkerLoad",
    "WorkerLost",
    "WorkerSet",
    "WorkerSetStatistics",
    "chain",
    "event_from_dict",
    "link",
    "named",
    "next_or_wait",
    "open_stream",
)
