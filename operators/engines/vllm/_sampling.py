"""One mapping from a request (:class:`~operators.contracts.llm.PreprocessedRequest`) to
vLLM's ``SamplingParams``.

Everything a request may ask of vLLM is checked and translated here, in the request's task
and before vLLM sees it, so that every refusal is an :class:`~pipeline.InvalidRequest`
naming the field (a 400), never a vLLM exception turned into a 500. The result is the
keyword arguments of ``SamplingParams`` (plain values: testable without vLLM);
:func:`sampling_params` makes vLLM's object of them, adding the grammar of a constrained
request.

What is decided here, and why:

- **Greedy is temperature 0; unset is 1.0**, OpenAI's default, as the llama engine reads
  it (and vLLM's own server, for a model without a default of its own). vLLM refuses ``n > 1`` with
  greedy sampling; greedy ``n > 1`` becomes temperature 1 with ``top_k=1``, which samples
  the most likely token every time: the same tokens as greedy decoding, and the same
  logprobs (vLLM reports the model's raw logprobs, before temperature and top-k).
- **Stop strings stay in our Backend** (the stop jail, which withholds text that may
  become one); vLLM gets only token ids: the user's ``stop_token_ids`` and the
  tokenizer's end-of-generation ids (unless ``ignore_eos``), so that it stops computing
  where the Backend would stop reading. Text is never decoded by vLLM (``detokenize``
  off): our Backend decodes once.
- **The budget**: ``max_tokens`` (Migration has subtracted what was replayed), or the
  context window's room when unset (vLLM's own default would be 16 tokens).
- **Outputs are deltas** (``RequestOutputKind.DELTA``): only new tokens cross from vLLM's
  output handler to the request's task.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Final, final

from operators.contracts.llm import PreprocessedRequest
from operators.engines._grammar import lark_grammar
from operators.engines._reasoning_budget import check_budget
from pipeline import InvalidRequest

__all__ = (
    "BUDGET_ARG",
    "EXTRA_ARG",
    "EngineLimits",
    "SamplingPlan",
    "budget_args",
    "plan_sampling",
    "replay_args",
    "sampling_params",
)

#: the ``SamplingParams.extra_args`` key carrying a replayed constraint (``_replay``)
EXTRA_ARG: Final = "llm_pipeline_replayed_constraint"
#: the ``SamplingParams.extra_args`` key carrying a reasoning budget (``_budget``)
BUDGET_ARG: Final = "llm_pipeline_reasoning_budget"

#: the largest ``logprobs`` vLLM returns unless configured otherwise (its ``max_logprobs``)
DEFAULT_MAX_LOGPROBS: Final = 20


@final
@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What one vLLM engine can take: its vocabulary and context window."""

    vocab_size: int
    max_model_len: int
    #: the tokenizer's end-of-generation ids (vLLM stops there unless ``ignore_eos``)
    eos_token_ids: Collection[int] = ()
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


@final
@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """A validated request, ready for vLLM."""

    #: choices
    n: int
    #: tokens each choice may generate (0: the request ends at once with "length")
    budget: int
    #: ``SamplingParams(**params)``, except ``output_kind`` and ``structured_outputs``
    #: (vLLM objects, added by :func:`sampling_params`)
    params: dict[str, Any]


def plan_sampling(
    request: PreprocessedRequest, request_id: str, limits: EngineLimits
) -> SamplingPlan:
    """Check ``request`` against ``limits`` and translate it.

    Raises:
        InvalidRequest: naming the field vLLM cannot honour, or the limit it exceeds.
    """

    def refuse(message: str, param: str) -> InvalidRequest:
        return InvalidRequest(message, param=param, request_id=request_id)

    prompt = request.token_ids
    if not prompt:
        raise refuse("the prompt is empty", "prompt")
    vocab = limits.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        bad = next(t for t in prompt if not 0 <= t < vocab)
        raise refuse(
            f"token id {bad} is not in this model's vocabulary (0..{vocab - 1}); was the "
            "prompt encoded with another model's tokenizer?",
            "prompt",
        )
    if request.multimodal:
        raise refuse("the vllm engine serves text only here", "messages")
    check_budget(request, request_id)
    room = limits.max_model_len - len(prompt)
    if room <= 0:
        raise refuse(
            f"the prompt has {len(prompt)} tokens; the model's context window holds "
            f"{limits.max_model_len}, prompt and output together",
            "prompt",
        )
    stop = request.stop
    budget = room if stop.max_tokens is None else stop.max_tokens
    if budget < 0:
        raise refuse(f"max_tokens must be >= 0, got {budget}", "max_tokens")
    if budget > room:
        raise refuse(
            f"prompt ({len(prompt)} tokens) + max_tokens ({budget}) = {len(prompt) + budget} "
            f"exceeds the context window of {limits.max_model_len} tokens: lower max_tokens "
            "or shorten the prompt",
            "max_tokens",
        )
    n = max(request.n, 1)
    params: dict[str, Any] = {
        "n": n,
        "max_tokens": budget,
        "min_tokens": min(stop.min_tokens, budget),
        "ignore_eos": stop.ignore_eos,
        "stop_token_ids": _stop_ids(request),
        "detokenize": False,
        "skip_special_tokens": False,
    }
    params.update(_sampling(request, n, refuse))
    logprobs = request.output.logprobs
    if logprobs is not None:
        if not 0 <= logprobs <= limits.max_logprobs:
            raise refuse(
                f"logprobs must be between 0 and {limits.max_logprobs}, got {logprobs}",
                "logprobs",
            )
        params["logprobs"] = logprobs
    return SamplingPlan(n=n, budget=budget, params=params)


def _stop_ids(request: PreprocessedRequest) -> list[int]:
    stop = request.stop
    ids = dict.fromkeys(stop.stop_token_ids)
    if not stop.ignore_eos:
        ids.update(dict.fromkeys(stop.eos_token_ids))
    return list(ids)


def _sampling(request: PreprocessedRequest, n: int, refuse: Any) -> dict[str, Any]:
    """The sampler's parameters, each checked against what vLLM accepts."""
    sampling = request.sampling
    params: dict[str, Any] = {}
    temperature = 1.0 if sampling.temperature is None else sampling.temperature
    if temperature < 0:
        raise refuse(f"temperature must be >= 0, got {temperature}", "temperature")
    top_k = sampling.top_k
    if top_k is not None:
        if top_k < -1:
            raise refuse(f"top_k must be -1, 0 (all tokens) or positive, got {top_k}", "top_k")
        params["top_k"] = max(top_k, 0)
    if temperature == 0.0 and n > 1:
        # vLLM refuses n > 1 when greedy; top_k=1 samples the argmax every time
        temperature, params["top_k"] = 1.0, 1
    params["temperature"] = temperature
    if sampling.top_p is not None:
        if not 0 < sampling.top_p <= 1:
            raise refuse(f"top_p must be in (0, 1], got {sampling.top_p}", "top_p")
        params["top_p"] = sampling.top_p
    if sampling.min_p is not None:
        if not 0 <= sampling.min_p <= 1:
            raise refuse(f"min_p must be in [0, 1], got {sampling.min_p}", "min_p")
        params["min_p"] = sampling.min_p
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if value is not None:
            if not -2 <= value <= 2:
                raise refuse(f"{name} must be in [-2, 2], got {value}", name)
            params[name] = value
    if sampling.repetition_penalty is not None:
        if not 0 < sampling.repetition_penalty <= 2:
            raise refuse(
                f"repetition_penalty must be in (0, 2], got {sampling.repetition_penalty}",
                "repetition_penalty",
            )
        params["repetition_penalty"] = sampling.repetition_penalty
    if sampling.seed is not None:
        if not -(2**63) <= sampling.seed < 2**64:
            raise refuse(f"seed must fit in 64 bits, got {sampling.seed}", "seed")
        params["seed"] = sampling.seed
    return params


def replay_args(grammar: str, replayed: Sequence[int]) -> dict[str, Any]:
    """``SamplingParams.extra_args`` for a request whose output must match the Lark
    ``grammar`` and already begins with ``replayed`` (a migrated constrained request: vLLM's
    own structured outputs would start the grammar afresh; ``_replay`` continues it)."""
    return {EXTRA_ARG: {"grammar": grammar, "replayed": list(replayed)}}


def budget_args(request: PreprocessedRequest) -> dict[str, Any]:
    """``SamplingParams.extra_args`` for ``request``'s reasoning budget (``_budget``): the
    markers, and the output replayed before this attempt (empty without a budget)."""
    budget = request.reasoning_budget
    if budget is None:
        return {}
    replayed = request.replayed_tokens
    return {
        BUDGET_ARG: {
            "param": budget.param,
            "tokens": budget.tokens,
            "end": list(budget.end),
            "start": list(budget.start),
            "open": budget.open,
            "replayed": request.token_ids[len(request.token_ids) - replayed :] if replayed else [],
        }
    }


def sampling_params(request: PreprocessedRequest, plan: SamplingPlan) -> Any:
    """vLLM's ``SamplingParams`` of ``plan`` (outputs as deltas), with ``request``'s
    constraint as vLLM's structured outputs, or, for a migrated constrained request, as the
    replay processor's arguments (see ``_replay``), and its reasoning budget as the budget
    processor's (``_budget``). Imports vLLM."""
    from vllm.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

    params = dict(plan.params)
    constraint = request.constraint
    if constraint is not None:
        grammar = lark_grammar(constraint)
        replayed = request.replayed_tokens
        if replayed:  # continue the grammar past the replayed output (see _replay)
            params["extra_args"] = replay_args(grammar, request.token_ids[-replayed:])
        else:
            params["structured_outputs"] = StructuredOutputsParams(grammar=grammar)
    budget = budget_args(request)
    if budget:
        params["extra_args"] = {**params.get("extra_args", {}), **budget}
    return SamplingParams(output_kind=RequestOutputKind.DELTA, **params)
