"""Refuse constrained requests in front of an engine that cannot honour them.

A request with ``response_format`` or ``tool_choice: "required"`` carries a
:class:`~operators.contracts.llm.Constraint`. An engine that knows nothing of constraints (the echo
engine, a user's engine) would answer it like any other, and the client, told 200, would
believe the output had been constrained. Engines declare the feature
(:data:`~operators.contracts.llm.CONSTRAINED_DECODING` in ``engine.features``); the default
graph puts this operator in front of one that does not, so the client gets a 400 naming the
field instead. Unconstrained requests pass through without a hop. A NATS worker does the
same with :func:`guarded` (its frontend cannot know what the worker's engine honours).
"""

from __future__ import annotations

from typing import final

from pipeline import Context, Engine, InvalidRequest, Stream, link
from pipeline.health import Supervised

from .llm import (
    CONSTRAINED_DECODING,
    Constraint,
    EngineOutput,
    PreprocessedRequest,
    engine_features,
)

__all__ = ("ConstraintGuard", "engine_name", "guarded")


def engine_name(engine: object) -> str:
    """What to call ``engine`` in a message: its class, or the class of the engine a
    :class:`~pipeline.health.Supervised` gate watches (the gate is not what answers)."""
    if isinstance(engine, Supervised) and engine.engine is not None:
        engine = engine.engine
    return type(engine).__name__


def guarded(
    engine: Engine[PreprocessedRequest, EngineOutput],
) -> Engine[PreprocessedRequest, EngineOutput]:
    """``engine``, behind a :class:`ConstraintGuard` unless it decodes under constraints."""
    if CONSTRAINED_DECODING in engine_features(engine):
        return engine
    return link(ConstraintGuard(engine_name(engine)), engine)


@final
class ConstraintGuard:
    """Operator: a constrained request fails with ``InvalidRequest(param=...)``; others pass.

    ``engine`` names what cannot honour the constraint, for the message.
    """

    def __init__(self, engine: str = "this engine") -> None:
        self._engine = engine

    def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, EngineOutput],
    ) -> Stream[EngineOutput]:
        """``downstream``'s stream, or a refusal for a constrained request."""
        constraint = ctx.data.constraint
        if constraint is None:
            return downstream.generate(ctx)
        return self._refuse(constraint)

    async def _refuse(self, constraint: Constraint) -> Stream[EngineOutput]:
        raise InvalidRequest(
            f"'{constraint.param}' needs constrained decoding, which {self._engine} does "
            "not support",
            param=constraint.param,
        )
        yield  # an async generator: the refusal comes when the stream is read
