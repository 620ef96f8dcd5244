"""Health that tells the truth: an engine that dies or freezes is noticed, reported, routed
around and rebuilt, whatever the engine.

Why: an engine's process can die (vLLM's engine core killed) or freeze (a stuck kernel, a
deadlock) while the server in front of it answers ``/health`` with 200, and a load balancer
keeps sending traffic into it. The graph sees every output an engine produces, so it can
judge any engine by what it does, without the engine's help::

    requests --> Supervised(engine) --> engine        counts: requests waiting, outputs
                      ^                               refuses: while stalled, failing, dead
                Health.run (one task)                 waits:   while starting, restarting
                  every tick: stalled? dead? canary due?

* **A stall** is an engine with requests waiting on its next output that has produced no
  output, and reported no progress, within ``stall_timeout`` seconds. Its in-flight
  requests are failed through their driver (:meth:`pipeline.Context.fail`) with
  :class:`~pipeline.EngineStalled` (a :class:`~pipeline.WorkerLost`: over a transport
  the frontend's Migration finishes them on another worker); new ones get
  :class:`~pipeline.EngineUnavailable` at once. Only requests *waiting* count: a client
  that stopped reading pauses its stream, not the engine. A long prefill is not a stall
  when the engine reports its work: an engine's ``progress`` attribute (an int that
  grows with each prefill chunk, each step) counts like an output.
* **A probe** (one small request, given by whoever knows what the engine takes) tells
  when a stalled, failing or rebuilt engine answers again; run every ``canary_interval``
  seconds on an idle engine it is **the canary**: a failure or a stall marks it not ready,
  a success ready again.
* **A death** (:class:`~pipeline.EngineDead` from a stream, or the engine's ``dead``
  attribute) fails its requests and rebuilds the engine from its ``factory``: at most
  ``restarts`` times in ``restart_window`` seconds, then it is dead beyond recovery and
  the process is no longer *live*. Requests arriving while it is rebuilt wait (within
  their deadline); a request already lost to it does not.
* **Readiness by model**: :class:`Health` knows the sources of each model's readiness
  (its supervised engines; or a :class:`~pipeline.WorkerSet` of workers elsewhere,
  which their discovery keeps to the ready ones) and answers ``live``, ``model(name)``,
  and ``refusal(name)`` (what a request gets at once when no engine of the model can
  answer). :meth:`Supervised.member_of` keeps an engine in a worker set only while it is
  ready, so routers go to the others meanwhile.

Engines need nothing to be watched; to be judged better they may have ``progress`` and
``dead`` attributes, and raise ``EngineDead`` when their process or thread is gone.
Everything here is the engine's graph seen from outside: no engine-specific code, no
asyncio-only code, one task per process, nothing per output but two additions.
"""

from __future__ import annotations

from .common import PROBE_RETRY as PROBE_RETRY
from .common import RETRY_AFTER as RETRY_AFTER
from .common import EngineState as EngineState
from .common import Probe as Probe
from .process import TICK as TICK
from .process import Health as Health
from .process import ModelHealth as ModelHealth
from .supervised import Supervised as Supervised

__all__ = (
    "PROBE_RETRY",
    "RETRY_AFTER",
    "TICK",
    "EngineState",
    "Health",
    "ModelHealth",
    "Probe",
    "Supervised",
)
