"""Speaking to a vLLM server: token ids in, token ids out.

Two routes carry token ids both ways, and the request is checked and mapped by the one
mapping the in-process vLLM engine uses (:func:`operators.engines.vllm._sampling.plan_sampling`),
so both engines refuse the same requests with the same 400s:

- ``POST /inference/v1/generate`` (vLLM 0.32, served with ``--enable-scale-out``): the
  request's ``token_ids`` and vLLM's own ``SamplingParams`` as JSON; chunks of
  ``choices[{index, token_ids, finish_reason, logprobs: {content: [{token_id, logprob,
  top_logprobs: [{token_id, logprob, rank}]}]}}]``, then ``usage``, then ``[DONE]``.
- ``POST /v1/completions`` with a token-id prompt and ``return_token_ids`` (every vLLM):
  the same sampling fields at the top level, ``choices[{index, token_ids, finish_reason,
  logprobs: {token_logprobs, top_logprobs: [{"token_id:N": logprob}]}}]`` (ids in the
  alternatives' keys with ``return_tokens_as_token_ids``).

What each side of the mapping decides, and why:

- **Alternatives by rank.** vLLM's per-position logprobs are the sampled token and the
  ``k`` best; ``/inference/v1/generate`` then keeps ``k`` entries with the sampled one
  first, dropping the ``k``-th best when the sampled token is not among them. So ``k + 1``
  are asked for there, and the ``k`` best kept (sorted by logprob, as the completions route
  needs anyway: its alternatives carry no rank).
- **Cached prompt tokens** (``usage.prompt_tokens_details.cached_tokens``, with vLLM's
  ``--enable-prompt-tokens-details``) arrive only after the last token: the choice that
  finishes last is held back until then (one chunk: vLLM sends the usage right after it)
  and carries them, as the engine contract allows any output to.
- **Structured output** is vLLM's ``structured_outputs`` with the Lark grammar our other
  engines use (:func:`operators.engines._grammar.lark_grammar`); vLLM starts a grammar at
  the first generated token, so a constrained request cannot continue after a migration
  (its replayed output would not be matched): refused with an ``EngineError``.
- **Priority** goes along when it is not 0; a vLLM without ``--scheduling-policy priority``
  refuses it, and that 400 names ``priority``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, final

from operators.contracts.llm import EngineOutput, FinishReason, PreprocessedRequest, TopLogprobs
from operators.engines._grammar import lark_grammar
from operators.engines.vllm._sampling import EngineLimits, SamplingPlan, plan_sampling
from pipeline import EngineError, StreamDisconnected

from ._detect import UpstreamInfo
from ._http import DONE, mid_stream

__all__ = ("GENERATE", "COMPLETIONS", "VllmCall", "VllmReader", "vllm_call")

GENERATE: Final = "/inference/v1/generate"
COMPLETIONS: Final = "/v1/completions"

_FINISH: Final[Mapping[str, FinishReason]] = {"stop": "stop", "length": "length"}
#: sampling fields ``/v1/completions`` takes as ``SamplingParams`` names them
_COMPLETION_FIELDS: Final = frozenset(
    {"n", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
     "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
     "repetition_penalty", "seed", "logprobs"}
)  # fmt: skip


@final
@dataclass(frozen=True, slots=True)
class VllmCall:
    """One request as vLLM takes it."""

    path: str
    body: dict[str, Any]
    plan: SamplingPlan


def vllm_call(
    request: PreprocessedRequest,
    request_id: str,
    info: UpstreamInfo,
    limits: EngineLimits,
    *,
    generate: bool,
) -> VllmCall:
    """``request`` for ``/inference/v1/generate`` (``generate``) or ``/v1/completions``.

    Raises:
        InvalidRequest: naming the field vLLM cannot honour (``plan_sampling``'s checks).
        EngineError: a constrained request that was migrated (see the module docstring).
    """
    plan = plan_sampling(request, request_id, limits)
    params = dict(plan.params)
    if info.max_model_len is None and request.stop.max_tokens is None:
        del params["max_tokens"]  # the server's own room, which it knows and we do not
    k = params.get("logprobs")
    constraint = request.constraint
    extra: dict[str, Any] = {}
    if constraint is not None:
        if request.replayed_tokens:
            raise EngineError(
                "a constrained request cannot continue on another vLLM server: vLLM starts "
                "its grammar at the first generated token, not after the replayed output",
                request_id=request_id,
            )
        extra["structured_outputs"] = {"grammar": lark_grammar(constraint)}
    if request.priority:
        extra["priority"] = request.priority
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    if generate:
        if k:  # the k-th best may be crowded out by the sampled token: ask for one more
            params["logprobs"] = min(k + 1, limits.max_logprobs)
        structured = extra.pop("structured_outputs", None)
        if structured is not None:
            params["structured_outputs"] = structured
        body = {"token_ids": list(request.token_ids), "sampling_params": params, **extra}
        return VllmCall(GENERATE, {**body, **stream}, plan)
    fields = {key: value for key, value in params.items() if key in _COMPLETION_FIELDS}
    body = {"model": info.model, "prompt": list(request.token_ids), **fields, **extra}
    body["return_token_ids"] = True
    if k is not None:
        body["return_tokens_as_token_ids"] = True
    return VllmCall(COMPLETIONS, {**body, **stream}, plan)


@final
class VllmReader:
    """vLLM's chunks (either route) as EngineOutputs, one per choice per chunk.

    :meth:`feed` takes each event (:data:`~._http.DONE` for ``[DONE]``); :meth:`end` is
    called when the stream ends and raises if a choice never finished.
    """

    __slots__ = ("_cached", "_held", "_k", "_open", "_request_id", "done", "generated")

    def __init__(self, n: int, logprobs: int | None, request_id: str) -> None:
        self._open = set(range(n))
        self._k = logprobs
        self._request_id = request_id
        self._held: EngineOutput | None = None
        self._cached: int | None = None
        #: every choice finished and the usage (or ``[DONE]``) came: nothing more to read
        self.done = False
        #: tokens received so far, over all choices
        self.generated = 0

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens vLLM found cached (None: it did not say)."""
        return self._cached

    def feed(self, event: dict[str, Any]) -> list[EngineOutput]:
        """The outputs of one event.

        Raises:
            StreamDisconnected: vLLM aborted a choice or failed (another server may not).
            InvalidRequest: vLLM refused the request mid-stream (a 4xx error event).
            EngineError: a finish reason of vLLM's we do not know.
        """
        if event is DONE:
            return self.end()
        if "error" in event:
            raise mid_stream(event, self._request_id)
        outputs: list[EngineOutput] = []
        for choice in event.get("choices") or ():
            output = self._output(choice)
            if output is None:
                continue
            if output.finish_reason is not None:
                self._open.discard(output.index)
                if not self._open:  # the last to finish waits for the usage
                    self._held = output
                    continue
            outputs.append(output)
        usage = event.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            self._cached = cached if isinstance(cached, int) else None
            if not self._open:
                outputs.extend(self._release())
        return outputs

    def end(self) -> list[EngineOutput]:
        """The held output, at the end of the stream.

        Raises:
            StreamDisconnected: some choice never finished.
        """
        if self._open:
            raise StreamDisconnected(
                f"the vLLM stream ended before choices {sorted(self._open)} finished",
                request_id=self._request_id,
            )
        return self._release()

    def _release(self) -> list[EngineOutput]:
        held, self._held = self._held, None
        self.done = True
        if held is None:
            return []
        held.cached_tokens = self._cached
        return [held]

    def _output(self, choice: dict[str, Any]) -> EngineOutput | None:
        index = int(choice.get("index", 0))
        ids = choice.get("token_ids") or []
        reason = choice.get("finish_reason")
        finish: FinishReason | None = None
        if reason is not None:
            finish = _FINISH.get(reason)
            if finish is None:
                if reason == "abort":  # vLLM dropped it (shutting down): another may not
                    raise StreamDisconnected(
                        f"vLLM aborted choice {index}", request_id=self._request_id
                    )
                raise EngineError(
                    f"vLLM ended choice {index} with {reason!r}", request_id=self._request_id
                )
        if not ids and finish is None:
            return None
        self.generated += len(ids)
        if self._k is None or not ids:
            return EngineOutput(list(ids), None, None, finish, index)
        values, tops = _logprobs(ids, choice.get("logprobs"), self._k, self._request_id)
        return EngineOutput(list(ids), values, tops, finish, index)


def _logprobs(
    ids: Sequence[int], logprobs: Any, k: int, request_id: str
) -> tuple[list[float], list[TopLogprobs]]:
    """The sampled tokens' logprobs and the ``k`` best alternatives, from either route."""
    if not isinstance(logprobs, dict):
        raise EngineError("vLLM sent no logprobs", request_id=request_id)
    content = logprobs.get("content")
    if content is not None:  # /inference/v1/generate
        if len(content) != len(ids):
            raise EngineError("vLLM's logprobs do not align with its tokens", request_id=request_id)
        values = [float(entry["logprob"]) for entry in content]
        tops = [
            _best(((c["token_id"], c["logprob"]) for c in entry.get("top_logprobs") or ()), k)
            for entry in content
        ]
        return values, tops
    sampled = logprobs.get("token_logprobs") or []
    alternatives = logprobs.get("top_logprobs") or []
    if len(sampled) != len(ids) or len(alternatives) != len(ids):
        raise EngineError("vLLM's logprobs do not align with its tokens", request_id=request_id)
    values = [float(value) for value in sampled]
    tops = [
        _best(((_token_id(key), lp) for key, lp in (entry or {}).items()), k)
        for entry in alternatives
    ]
    return values, tops


def _best(candidates: Any, k: int) -> TopLogprobs:
    """The ``k`` most likely of ``(token id, logprob)`` candidates, most likely first."""
    ranked = sorted(((float(lp), int(token)) for token, lp in candidates), reverse=True)
    return [(token, lp) for lp, token in ranked[:k]]


def _token_id(key: str) -> int:
    """The id in a ``token_id:N`` key (``return_tokens_as_token_ids``)."""
    return int(key.rpartition(":")[2])
