"""The planner: workers scaled to the load against latency targets (``llm-pipeline planner``).

::

    serve --nats frontends --latency summaries--+
    workers ---------------load reports---------+--> Planner --decide()--> Connector
    discovery, KV events -----------------------+       |  (scale_to, list)
                                                        +--> drain_worker (NATS), /metrics

One module per part:

- :mod:`.policy`: the decision rule, a pure function (:func:`~.policy.decide`) of a
  :class:`~.policy.Policy` (targets, bounds, headroom, cool-down), what was learned of the
  pool's capacity (:class:`~.policy.Learned`) and one interval's :class:`~.policy.Observation`.
- :mod:`.pools`: :class:`~.pools.PlannedPool`, a model's workers in one role.
- :mod:`.latency` and :mod:`.wire`: the frontends' histogram deltas (published by
  :class:`~.latency.LatencyReporter`, merged by :class:`~.latency.Latencies`) and the
  planner's subjects and messages; :mod:`.status`: a frontend's view of the planner.
- :mod:`.load_averages`: the workers' load reports, averaged over an interval (not
  :class:`pipeline.LoadLedger`, which is a router's count of its own requests).
- :mod:`.connector`: the :class:`~.connector.Connector` protocol; :mod:`.local`: the
  local connector (worker processes from a command template, restarted with back-off).
- :mod:`.planner`: the loop (needs the ``[nats]`` extra; :class:`Planner` is imported on
  first use); :mod:`.metrics` and :mod:`.http`: its ``/metrics`` and ``/status``.

``docs/design.md`` ("The planner") says why these inputs, why this rule, and why a drain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .connector import Connector as Connector
from .connector import ManagedWorker as ManagedWorker
from .latency import Latencies as Latencies
from .latency import LatencyReporter as LatencyReporter
from .local import LocalConnector as LocalConnector
from .policy import Decision as Decision
from .policy import Learned as Learned
from .policy import Observation as Observation
from .policy import Policy as Policy
from .policy import Targets as Targets
from .policy import decide as decide
from .pools import PlannedPool as PlannedPool

if TYPE_CHECKING:
    from .planner import Planner as Planner

__all__ = (
    "Connector",
    "Decision",
    "Latencies",
    "LatencyReporter",
    "Learned",
    "LocalConnector",
    "ManagedWorker",
    "Observation",
    "PlannedPool",
    "Planner",
    "Policy",
    "Targets",
    "decide",
)


def __getattr__(name: str) -> Any:
    """``Planner``, imported when first asked for (it needs the ``[nats]`` extra)."""
    if name != "Planner":
        raise AttributeError(f"module 'operators.planner' has no attribute {name!r}")
    from .planner import Planner

    globals()[name] = Planner
    return Planner
