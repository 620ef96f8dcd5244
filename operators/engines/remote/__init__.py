"""The remote engine: unmodified vLLM and llama-server processes behind the graph.

``llm-pipeline serve --engine remote --upstream URL [--upstream URL ...]`` serves the
default graph (templates, tokenizing, stop strings, tool calls, Responses, Messages,
Migration, routing) over servers someone else runs: each gets token ids and answers token
ids, so everything the graph does works as for an in-process engine, and a server that
dies mid-stream is continued by another from prompt + output so far. docs/engines.md
("Wrapping an engine that is a server of its own") and docs/design.md say why.

The modules, from the request inwards:

- :mod:`.engine` — :class:`RemoteEngine`, one server: sending, streaming, aborting, its
  load and its KV events.
- ``_vllm`` / ``_llama`` — each kind's request mapping and stream reader (vLLM's
  ``/inference/v1/generate`` or ``/v1/completions``; llama-server's ``/completion``).
- ``_gaps`` — the token ids llama-server leaves out of its stream, recovered.
- ``_http`` — server-sent events, and the servers' failures as our errors.
- ``_detect`` — what a server is and serves, asked of it.
- ``_load`` — its load report, as said and in the router's unit.
- ``_fleet`` — several servers as one WorkerSet, watched (:func:`open_upstreams`).
- ``_metrics`` — the ``llm_pipeline_upstream_*`` series.
- ``_spec`` — ``--upstream URL[,kv=tcp://HOST:PORT]``.

Needs only httpx (a base dependency); following a vLLM's KV events (``kv=``) needs pyzmq
and msgspec (the ``[remote]`` extra; vLLM brings both).
"""

from __future__ import annotations

from ._detect import UpstreamInfo as UpstreamInfo
from ._fleet import DEFAULT_POLL_INTERVAL as DEFAULT_POLL_INTERVAL
from ._fleet import UpstreamFleet as UpstreamFleet
from ._fleet import open_upstreams as open_upstreams
from ._load import UpstreamLoad as UpstreamLoad
from ._metrics import UpstreamCollector as UpstreamCollector
from ._spec import KINDS as KINDS
from ._spec import Upstream as Upstream
from ._spec import UpstreamKind as UpstreamKind
from ._spec import parse_upstream as parse_upstream
from .engine import RemoteEngine as RemoteEngine
from .engine import RemoteStatistics as RemoteStatistics

__all__ = (
    "DEFAULT_POLL_INTERVAL",
    "KINDS",
    "RemoteEngine",
    "RemoteStatistics",
    "Upstream",
    "UpstreamCollector",
    "UpstreamFleet",
    "UpstreamInfo",
    "UpstreamKind",
    "UpstreamLoad",
    "open_upstreams",
    "parse_upstream",
)
