"""How the planner's decisions are carried out: the :class:`Connector` protocol.

The planner decides how many workers each pool (a model's workers in one role) should
have; a connector makes it so, wherever workers run. It is two calls::

    await connector.scale_to("smol", "aggregated", 3)                 # start one more
    await connector.scale_to("smol", "aggregated", 2, leaving=["aggregated-1f3e"])
    connector.list()   # [ManagedWorker(model, role, worker_id, state, ...), ...]

``scale_to`` returns once the change is under way, not done: new workers take their time
to load and register (the planner counts a worker as serving only once discovery shows it
ready), and a worker leaving drains first. A step down names the workers ``leaving``: the
planner chose them (the least work in flight, the least KV cache only they hold) and has
already told them over NATS to drain (:func:`pipeline.transports.nats.drain_worker`), so
they deregister at once and exit by themselves once drained; the connector must not start
others in their place, and must not kill them. Should it have to choose itself (fewer named
than must go), it takes workers not serving yet first, and drains the others the way its
platform does (SIGTERM, which the worker answers with the same drain).

Two connectors are designed here; ``--connector local`` is the one built
(:class:`~.local.LocalConnector`: worker processes on this machine, restarted when they
crash). A Kubernetes connector is described in ``docs/design.md`` ("The planner"): a pool
is a Deployment, ``scale_to`` patches its ``replicas`` after lowering the leaving pods'
``controller.kubernetes.io/pod-deletion-cost``, so that the ReplicaSet deletes those pods
(whose SIGTERM then finds them draining already) and no other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ("Connector", "ManagedWorker", "WorkerState")

WorkerState = Literal["running", "restarting", "leaving"]
"""A managed worker's state: its process runs (loading or serving: discovery tells which),
it crashed and waits for its restart, or it is draining on its way out."""


@dataclass(frozen=True, slots=True)
class ManagedWorker:
    """One worker a connector runs for a pool."""

    model: str
    role: str
    #: the id it registers under (a restarted worker gets a new one)
    worker_id: str
    state: WorkerState
    #: times this worker's slot was restarted after a crash or a failed start
    restarts: int = 0
    #: what the connector last had to say about it (an exit code, a back-off)
    detail: str = ""


class Connector(Protocol):
    """What carries the planner's decisions out (see the module docstring)."""

    async def scale_to(self, model: str, role: str, n: int, *, leaving: Sequence[str] = ()) -> None:
        """Keep ``n`` workers of ``model`` in ``role``; on a step down, ``leaving`` names the
        workers to go (told to drain already). Returns once the change is under way."""
        ...

    def list(self) -> Sequence[ManagedWorker]:
        """The workers it runs now, every pool's (those leaving included)."""
        ...
