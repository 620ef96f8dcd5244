"""What a chat request's reasoning settings become: chat-template variables, and a budget.

Every edge's reasoning settings arrive here as a chat request's two fields, and nothing
else reads them, so the three APIs cannot treat them apart::

    chat        reasoning_effort            thinking_token_budget (vLLM's extension)
    Responses   reasoning.effort            -
    Messages    thinking: disabled ("none") thinking: enabled, budget_tokens

What each becomes (:func:`reasoning_plan`), honoured or refused by name, never ignored:

- ``reasoning_effort`` goes to the chat template as ``reasoning_effort``, with
  ``enable_thinking`` (false for ``none``, true otherwise), as vLLM passes them: templates
  that read them (gpt-oss reads the effort, Qwen 3 ``enable_thinking``) get them.
- ``none`` turns reasoning off through the template; where the template reads no
  ``enable_thinking`` and the model reasons (the server parses its reasoning), that is
  impossible: a 400. A model not known to reason has nothing to turn off.
- Any other effort is honoured by a template that reads it. Where none does, it becomes a
  reasoning budget of the effort's share of the request's output limit (minimal 10 %,
  low 20 %, medium 50 %, high 80 %, xhigh 90 %, as OpenRouter maps efforts to budgets;
  ``max`` is no budget at all), so a reasoning model with any template reasons less at a
  lower effort. Without a reasoning format (``--reasoning-parser``) the server cannot tell
  reasoning from the answer: a 400.
- ``thinking_token_budget`` is a budget of that many tokens (``enable_thinking`` true).

A budget is the model's end-of-reasoning marker forced past so many reasoning tokens
(:class:`~operators.contracts.llm.ReasoningBudget`); the markers are the reasoning format's
(the parser's own), encoded once with the model's tokenizer (:class:`ReasoningMarkers`).
An engine that cannot force tokens refuses it, by the budget's field
(:class:`~operators.contracts.constraint_guard.ConstraintGuard`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from operators.contracts.llm import ReasoningBudget
from pipeline import InvalidRequest

if TYPE_CHECKING:
    from .chat_template import ChatTemplate
    from .protocol import ChatCompletionRequest

__all__ = (
    "EFFORT_BASE_TOKENS",
    "EFFORT_SHARES",
    "ReasoningMarkers",
    "ReasoningPlan",
    "reasoning_plan",
)

#: the share of the output limit each effort may spend reasoning (``max``: no limit)
EFFORT_SHARES: Final[Mapping[str, float]] = {
    "minimal": 0.1,
    "low": 0.2,
    "medium": 0.5,
    "high": 0.8,
    "xhigh": 0.9,
}
#: the output limit an effort's share is taken of when a request has none (no
#: ``max_tokens``, no context length)
EFFORT_BASE_TOKENS: Final = 32_768


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    """A reasoning format's markers as token ids of the model's tokenizer (what a budget
    counts between and forces)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    #: the format starts inside the reasoning (its template opens it in the prompt)
    open: bool

    @classmethod
    def of(cls, reasoning: object, encode: Callable[[str], list[int]]) -> ReasoningMarkers | None:
        """The markers of the format ``reasoning`` (None: it has no end marker to force, a
        user's format that is not a marker format)."""
        end = getattr(reasoning, "end", None)
        if not isinstance(end, str) or not end:
            return None
        start = getattr(reasoning, "start", None)
        return cls(
            tuple(encode(start)) if isinstance(start, str) and start else (),
            tuple(encode(end)),
            bool(getattr(reasoning, "starts_in_reasoning", False)),
        )


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """What a request's reasoning settings ask of the template and the engine."""

    #: what the chat template gets besides the messages
    variables: Mapping[str, Any] = field(default_factory=dict)
    #: the field a budget comes from (None: no budget)
    param: str | None = None
    #: the budget's tokens, when the request gave them
    tokens: int | None = None
    #: the budget's share of the output limit, when an effort gave it
    share: float | None = None

    def budget(self, markers: ReasoningMarkers, max_tokens: int | None) -> ReasoningBudget | None:
        """The budget for a request whose output limit is ``max_tokens`` (None: none)."""
        if self.param is None:
            return None
        tokens = self.tokens
        if tokens is None:
            limit = EFFORT_BASE_TOKENS if max_tokens is None else max_tokens
            tokens = math.ceil((self.share or 0.0) * limit)
        return ReasoningBudget(
            param=self.param, tokens=tokens, end=markers.end, start=markers.start, open=markers.open
        )


_NONE: Final = ReasoningPlan()


def reasoning_plan(
    request: ChatCompletionRequest,
    template: ChatTemplate,
    *,
    reasons: bool,
    markers: ReasoningMarkers | None,
) -> ReasoningPlan:
    """What ``request``'s reasoning settings ask, rendered through ``template``; ``reasons``:
    the server parses the model's reasoning (a reasoning format is configured), whose
    ``markers`` a budget forces (None: the format has none).

    Raises:
        InvalidRequest: a setting that cannot be honoured, naming its field.
    """
    effort = request.reasoning_effort
    tokens = request.thinking_token_budget
    if effort is None and tokens is None:
        return _NONE
    variables: dict[str, Any] = {}
    param = share = None
    if effort is not None:
        variables["reasoning_effort"] = effort
        variables["enable_thinking"] = effort != "none"
        if effort == "none":
            if reasons and not template.reads("enable_thinking", True, False):
                raise InvalidRequest(
                    "this model's reasoning cannot be turned off: its chat template reads no "
                    "'enable_thinking'",
                    param="reasoning_effort",
                )
        elif not template.reads("reasoning_effort", "low", "high"):
            if not reasons:
                raise InvalidRequest(
                    f"reasoning effort '{effort}' cannot be honoured: the model's chat template "
                    "does not read it and the server parses no reasoning (--reasoning-parser)",
                    param="reasoning_effort",
                )
            share = EFFORT_SHARES.get(effort)
            param = None if share is None else "reasoning_effort"
    if tokens is not None:
        variables["enable_thinking"] = True
        param, share = "thinking_token_budget", None
        if not reasons:
            raise InvalidRequest(
                "a reasoning budget cannot be kept: the server parses no reasoning "
                "(--reasoning-parser), so nothing tells the model's reasoning from its answer",
                param=param,
            )
    if param is not None and markers is None:
        raise InvalidRequest(
            "a reasoning budget cannot be kept: the reasoning format has no end marker to "
            "end the reasoning with",
            param=param,
        )
    return ReasoningPlan(variables, param, tokens, share)
