"""RetryElsewhere: a routing policy whose retries go to a worker the request has not tried.

Apart from :mod:`.transport` (which re-exports it) because it needs no transport: the
frontend's NATS worker sets use it, and so do the upstream servers of ``--engine remote``
(:mod:`operators.engines.remote`), where a retry after a lost stream must not go back to
the server that just failed while another one is there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from pipeline import Context, RoundRobin, RoutingPolicy, StateKey, Worker

__all__ = ("RetryElsewhere",)


@final
class RetryElsewhere:
    """Routing policy: ``policy`` (round-robin by default), but a request's retry goes to a
    worker it has not tried.

    The workers a request was sent to are kept in its Context state, which Migration's
    attempts (child contexts) share; a later attempt lets ``policy`` choose among the
    members not tried yet, or among all of them once every member was tried. So a retry
    never goes back to the worker that was just lost while another one is there, even when
    the loss was a timeout that discovery cannot act on (it evicts on "no responders").
    """

    __slots__ = ("_tried", "policy")

    def __init__(self, policy: RoutingPolicy | None = None) -> None:
        #: what picks among the untried workers
        self.policy: RoutingPolicy = RoundRobin() if policy is None else policy
        # One key per policy: the decode and prefill routers of one request keep apart.
        self._tried: StateKey[set[str]] = StateKey("workers tried by a RetryElsewhere router")

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """``policy``'s choice among the members ``ctx`` has not tried (or all)."""
        tried = ctx.state.get(self._tried, None)
        if tried is None:
            tried = set()
            ctx.state.set(self._tried, tried)
        elif fresh := [worker for worker in workers if worker.id not in tried]:
            workers = fresh
        worker = self.policy.choose(workers, ctx)
        tried.add(worker.id)
        return worker

    def __repr__(self) -> str:
        return f"RetryElsewhere({self.policy!r})"
