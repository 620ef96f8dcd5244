"""A reasoning budget in vLLM: past it, the end marker's tokens are forced.

vLLM 0.32 has a thinking budget of its own (``SamplingParams.thinking_token_budget``), but
its markers are the engine's, set once at start (``--reasoning-config`` or a vLLM reasoning
parser), and a request carrying a budget is refused unless they are. Here the markers come
with the request (:class:`~operators.contracts.llm.ReasoningBudget`: the frontend's
reasoning format, encoded with the model's tokenizer), so the engine needs no reasoning
configuration of its own and counts exactly as the llama engine does: the same
:class:`~operators.engines._reasoning_budget.ReasoningClock`, advanced by each step's output
tokens; when it names a token, every other token's logit becomes ``-inf``.

It runs in vLLM's engine-core process, which loads it by name (``logits_processors``);
requests without ``_sampling.BUDGET_ARG`` in ``SamplingParams.extra_args`` pay one dict
lookup when they join the batch. Nothing here may raise into vLLM's step: a malformed
argument is logged and the request runs without a budget (the frontend built it, so that
is a bug, not a client's mistake).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from operators.contracts.llm import ReasoningBudget
from operators.engines._reasoning_budget import ReasoningClock

from ._sampling import BUDGET_ARG

with warnings.catch_warnings():  # (torch's and vLLM's import-time deprecations)
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    try:
        from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
    except ImportError:  # the [vllm] extra is missing: VllmEngine() says so; vLLM alone loads this
        AdapterLogitsProcessor = object

__all__ = ("ReasoningBudgetProcessor",)

logger = logging.getLogger("operators.engines.vllm")


class ReasoningBudgetProcessor(AdapterLogitsProcessor):  # type: ignore[misc]
    """vLLM logits processor: forces the end of a choice's reasoning past its budget (see
    the module docstring). Built by vLLM once per engine, with its config."""

    def is_argmax_invariant(self) -> bool:
        """It changes which token is most likely: it applies to greedy requests too."""
        return False

    def new_req_logits_processor(self, params: Any) -> Callable[..., Any] | None:
        spec = (params.extra_args or {}).get(BUDGET_ARG)
        if spec is None:
            return None
        try:
            clock = _clock(spec)
        except Exception:  # never into vLLM's step
            logger.exception("a reasoning budget could not be set up; the request runs without")
            return None
        consumed = 0

        def step(output_ids: list[int], logits: Any) -> Any:
            nonlocal consumed
            for token in output_ids[consumed:]:
                clock.advance(token)
            consumed = len(output_ids)
            forced = clock.forced
            if forced is None or not 0 <= forced < logits.shape[-1]:
                return logits
            logits.fill_(float("-inf"))
            logits[forced] = 0.0
            return logits

        return step


def _clock(spec: Mapping[str, Any]) -> ReasoningClock:
    budget = ReasoningBudget(
        param=str(spec["param"]),
        tokens=int(spec["tokens"]),
        end=tuple(int(token) for token in spec["end"]),
        start=tuple(int(token) for token in spec["start"]),
        open=bool(spec["open"]),
    )
    return ReasoningClock(budget, [int(token) for token in spec["replayed"]])
