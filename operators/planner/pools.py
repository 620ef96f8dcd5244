"""What the planner plans: :class:`PlannedPool`, a model's workers in one role.

Each pool answers for the latencies its role controls: a prefill pool the time to the first
token, a decode pool the time between tokens, an aggregated pool both; its load is the
requests its workers hold (waiting and decoding), a prefill pool's the prompt tokens
queued (what a prefill worker's work is made of).

Apart from the loop (:mod:`.planner`, which needs the ``[nats]`` extra) so that the command
line can build pools from its arguments without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .policy import Policy, Targets

__all__ = ("PlannedPool",)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedPool:
    """A pool to plan: ``model``'s workers in ``role``, under ``policy``."""

    model: str
    role: str
    policy: Policy

    @property
    def targets(self) -> Targets:
        """The targets this pool answers for (its role's: see the module docstring)."""
        targets = self.policy.targets
        if self.role == "prefill":
            return Targets(ttft_p90=targets.ttft_p90)
        if self.role == "decode":
            return Targets(itl_p90=targets.itl_p90)
        return targets

    def load(self, numbers: Mapping[str, float]) -> float:
        """This pool's load in the reports' ``numbers``."""
        if self.role == "prefill":
            return numbers.get("prefill", 0.0)
        return numbers.get("waiting", 0.0) + numbers.get("decoding", 0.0)
