"""RetryElsewhere: a request's retry goes to a worker it has not tried, whatever the policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from operators.contracts.transport import RetryElsewhere
from pipeline import Context, Worker
from pipeline.testing import ScriptedEngine, make_context

WORKERS: list[Worker[Any, Any]] = [
    Worker(name, ScriptedEngine(lambda ctx: [])) for name in ("a", "b", "c")
]


class Always:
    """A policy that wants worker ``b`` whenever it is offered."""

    def __init__(self) -> None:
        self.offered: list[list[str]] = []

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        self.offered.append([worker.id for worker in workers])
        return next((worker for worker in workers if worker.id == "b"), workers[0])


def test_the_default_is_round_robin_over_fresh_requests() -> None:
    policy = RetryElsewhere()
    chosen = [policy.choose(WORKERS, make_context(None)).id for _ in range(4)]
    assert chosen == ["a", "b", "c", "a"]


def test_a_retry_is_offered_only_the_workers_not_tried_then_all() -> None:
    inner = Always()
    policy = RetryElsewhere(inner)
    ctx = make_context(None)
    attempts = [policy.choose(WORKERS, ctx.child(None)).id for _ in range(4)]
    # the wrapped policy's favourite first, then the others, then everyone again
    assert attempts == ["b", "a", "c", "b"]
    assert inner.offered == [["a", "b", "c"], ["a", "c"], ["c"], ["a", "b", "c"]]
    # another request starts afresh
    assert policy.choose(WORKERS, make_context(None)).id == "b"
