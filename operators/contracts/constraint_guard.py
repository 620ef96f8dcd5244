"""Refuse requests whose decoding an engine cannot control, in front of that engine.

Two things a request may ask of how its tokens are chosen, beyond the base contract:

- a :class:`~operators.contracts.llm.Constraint` (``response_format``, ``tool_choice:
  "required"``): the output must match it (the feature
  :data:`~operators.contracts.llm.CONSTRAINED_DECODING`);
- a :class:`~operators.contracts.llm.ReasoningBudget` (Anthropic's ``thinking.budget_tokens``,
  a reasoning effort): the model's reasoning must end after so many tokens (the feature
  :data:`~operators.contracts.llm.REASONING_BUDGET`).

An engine that knows nothing of them (the echo engine, a user's engine) would answer such a
request like any other, and the client, told 200, would believe it had been honoured.
Engines declare what they honour (``engine.features``); the default graph puts this
operator in front of one that lacks a feature, so the client gets a 400 naming the field
instead. Requests that ask for neither pass through without a hop. A NATS worker does the
same with :func:`guarded` (its frontend cannot know what the worker's engine honours).
"""

from __future__ import annotations

from typing import Final, final

from pipeline import Context, Engine, InvalidRequest, Stream, link
from pipeline.health import Supervised

from .llm import (
    CONSTRAINED_DECODING,
    REASONING_BUDGET,
    EngineOutput,
    PreprocessedRequest,
    engine_features,
)

__all__ = ("GUARDED", "ConstraintGuard", "engine_name", "guarded")

#: the features this guard stands in for when an engine lacks them
GUARDED: Final = frozenset({CONSTRAINED_DECODING, REASONING_BUDGET})


def engine_name(engine: object) -> str:
    """What to call ``engine`` in a message: its class, or the class of the engine a
    :class:`~pipeline.health.Supervised` gate watches (the gate is not what answers)."""
    if isinstance(engine, Supervised) and engine.engine is not None:
        engine = engine.engine
    return type(engine).__name__


def guarded(
    engine: Engine[PreprocessedRequest, EngineOutput],
) -> Engine[PreprocessedRequest, EngineOutput]:
    """``engine``, behind a :class:`ConstraintGuard` unless it honours every guarded
    feature."""
    features = engine_features(engine)
    if GUARDED <= features:
        return engine
    return link(ConstraintGuard(engine_name(engine), features=features), engine)


@final
class ConstraintGuard:
    """Operator: a request asking for what the engine lacks fails with
    ``InvalidRequest(param=...)``; others pass.

    ``engine`` names what cannot honour it, for the message; ``features`` are what it
    does honour (none by default: every constraint and budget is refused).
    """

    def __init__(self, engine: str = "this engine", *, features: frozenset[str] = frozenset()):
        self._engine = engine
        self._constraints = CONSTRAINED_DECODING in features
        self._budgets = REASONING_BUDGET in features

    def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, EngineOutput],
    ) -> Stream[EngineOutput]:
        """``downstream``'s stream, or a refusal of what the engine cannot honour."""
        request = ctx.data
        constraint = request.constraint
        if constraint is not None and not self._constraints:
            return self._refuse(
                f"'{constraint.param}' needs constrained decoding, which {self._engine} does "
                "not support",
                constraint.param,
            )
        budget = request.reasoning_budget
        if budget is not None and not self._budgets:
            return self._refuse(
                f"'{budget.param}' needs an engine that can end the model's reasoning, which "
                f"{self._engine} cannot (the llama and vllm engines can)",
                budget.param,
            )
        return downstream.generate(ctx)

    async def _refuse(self, message: str, param: str) -> Stream[EngineOutput]:
        raise InvalidRequest(message, param=param)
        yield  # an async generator: the refusal comes when the stream is read
