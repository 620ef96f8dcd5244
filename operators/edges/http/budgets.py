"""Where each key's use of its limits is kept: :class:`Budgets`, in this process
(:class:`LocalBudgets`) or shared by every frontend (:mod:`.nats_budgets`).

The arithmetic is :mod:`.limits`'; a store keeps one :class:`~.limits.Budget` per key
name and applies :func:`~.limits.admit` and :func:`~.limits.release` to it. The limits
come with each call (the tenant's), so a reload that changes a key's limits applies to
what the key has already used, and a store never holds a stale copy of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, final

from .limits import Ask, Budget, Standing, Verdict, admit, release, standing

if TYPE_CHECKING:
    from .tenants import Tenant

__all__ = ("Budgets", "LocalBudgets")


class Budgets(Protocol):
    """What every key has used of its limits."""

    async def take(self, tenant: Tenant, ask: Ask, /) -> Verdict:
        """Take ``ask`` from the key's budget if its limits allow it (else nothing)."""
        ...

    async def give(self, tenant: Tenant, back: Ask, /) -> None:
        """Give ``back`` (a refund, or a settlement: negative tokens charge more)."""
        ...


@final
class LocalBudgets:
    """Every key's budget in this process (``clock``: seconds, the wall clock's by
    default), by name: as many as the keys file has named since the start."""

    __slots__ = ("_budgets", "_clock")

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._budgets: dict[str, Budget] = {}
        self._clock = clock

    async def take(self, tenant: Tenant, ask: Ask, /) -> Verdict:
        """See :meth:`Budgets.take`."""
        return self.take_now(tenant, ask)

    async def give(self, tenant: Tenant, back: Ask, /) -> None:
        """See :meth:`Budgets.give`."""
        self.give_now(tenant, back)

    def take_now(self, tenant: Tenant, ask: Ask) -> Verdict:
        """:meth:`take`, without awaiting (a shared store's fallback calls it)."""
        now = self._clock()
        budget = self._budgets.get(tenant.name, _EMPTY)
        after, verdict = admit(budget, tenant.limits, ask, now)
        if verdict.admitted:
            self._budgets[tenant.name] = after
        return verdict

    def give_now(self, tenant: Tenant, back: Ask) -> None:
        """:meth:`give`, without awaiting."""
        budget = self._budgets.get(tenant.name)
        if budget is not None:
            self._budgets[tenant.name] = release(budget, tenant.limits, back, self._clock())

    def standing(self, tenant: Tenant, /) -> tuple[Standing | None, Standing | None]:
        """The key's (requests, tokens) limits as a client is told them now."""
        return standing(self._budgets.get(tenant.name, _EMPTY), tenant.limits, self._clock())

    def __repr__(self) -> str:
        return f"LocalBudgets({len(self._budgets)} keys in use)"


_EMPTY = Budget()
