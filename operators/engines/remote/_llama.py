"""Speaking to llama-server: ``POST /completion`` with a token-id prompt and ``return_tokens``.

The request is checked by the one mapping every vLLM-like engine shares
(:func:`operators.engines.vllm._sampling.plan_sampling`: the same 400s for the same
requests), then its fields are renamed to llama-server's, with every sampler llama-server
would otherwise apply by its own defaults set to what OpenAI's API means when a field is
absent (``top_k`` 40, ``top_p`` 0.95, ``min_p`` 0.05 and its server flags are llama-server's
defaults, not the request's). What llama-server cannot honour is refused by name:
``min_tokens`` (it has none), ``n`` above its slots, a ``seed`` outside 32 bits, a
``priority`` other than 0 (it schedules first come, first served), and structured output
other than one JSON value (``json_schema``: a required tool call's prefix and suffix would
need a grammar around the schema).

``max_tokens``: llama-server streams a token only once its character is whole, so a budget
that ends inside a character would lose that character's first tokens: it is asked for up
to :data:`OVERSHOOT` more, and the reader cuts the output at the budget itself (closing the
stream then aborts what llama-server would still generate).

Stop token ids are not sent (it takes none): llama-server stops at its model's end of
generation, and the Backend stops reading at the user's ids, which closes the stream.

Its stream: one chunk per token (``index``, ``tokens`` with one id, ``tokens_predicted``,
``completion_probabilities``, ``timings`` with ``cache_n``: the prompt tokens it reused),
then per choice a last chunk with ``stop: true`` and its ``stop_type`` (``eos``, ``word``,
``limit``). Tokens it left out of the stream (a character spelled in several tokens) are
recovered by :class:`~._gaps.GapFiller`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, final

from operators.contracts.llm import EngineOutput, FinishReason, PreprocessedRequest, TopLogprobs
from operators.engines.vllm._sampling import EngineLimits, SamplingPlan, plan_sampling
from pipeline import EngineError, InvalidRequest, StreamDisconnected

from ._detect import UpstreamInfo
from ._gaps import GapFiller
from ._http import mid_stream

__all__ = ("COMPLETION", "LlamaCall", "LlamaReader", "llama_call")

COMPLETION: Final = "/completion"

_FINISH: Final[dict[str, FinishReason]] = {"eos": "stop", "word": "stop", "limit": "length"}
#: what the last chunk of a choice needs to carry (its generation settings are kilobytes)
_FINAL_FIELDS: Final = ("index", "stop", "stop_type", "tokens", "tokens_predicted")
#: llama.cpp's seeds are 32-bit, and 0xFFFFFFFF means "random"
_SEEDS: Final = 2**32 - 1
#: tokens asked beyond the budget: a character's last token may come up to 3 after the
#: budget's (4 UTF-8 bytes), and llama-server never streams the others without it
OVERSHOOT: Final = 3


@final
@dataclass(frozen=True, slots=True)
class LlamaCall:
    """One request as llama-server takes it."""

    path: str
    body: dict[str, Any]
    plan: SamplingPlan


def llama_call(
    request: PreprocessedRequest, request_id: str, info: UpstreamInfo, limits: EngineLimits
) -> LlamaCall:
    """``request`` for llama-server's ``/completion``.

    Raises:
        InvalidRequest: naming the field llama-server cannot honour.
        EngineError: a constrained request that was migrated (the grammar would start
            again after the replayed output).
    """

    def refuse(message: str, param: str) -> InvalidRequest:
        return InvalidRequest(f"llama-server {message}", param=param, request_id=request_id)

    plan = plan_sampling(request, request_id, limits)
    params = plan.params
    if params["min_tokens"]:
        raise refuse("has no min_tokens: it stops at the model's end of text", "min_tokens")
    if info.slots is not None and plan.n > info.slots:
        raise refuse(f"runs at most {info.slots} sequences at once (n)", "n")
    if request.priority:
        raise refuse("schedules every request alike: it takes no priority", "priority")
    seed = params.get("seed")
    if seed is not None and not 0 <= seed < _SEEDS:
        raise refuse(f"takes a seed from 0 to {_SEEDS - 1}, not {seed}", "seed")
    body: dict[str, Any] = {
        "prompt": list(request.token_ids),
        "n_predict": min(plan.budget + OVERSHOOT, limits.max_model_len - len(request.token_ids)),
        "temperature": params["temperature"],
        "top_k": params.get("top_k", 0),
        "top_p": params.get("top_p", 1.0),
        "min_p": params.get("min_p", 0.0),
        "typical_p": 1.0,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "dry_multiplier": 0.0,
        "mirostat": 0,
        "repeat_penalty": params.get("repetition_penalty", 1.0),
        "presence_penalty": params.get("presence_penalty", 0.0),
        "frequency_penalty": params.get("frequency_penalty", 0.0),
        "ignore_eos": params["ignore_eos"],
        "cache_prompt": True,
        "stream": True,
        "return_tokens": True,
        "timings_per_token": True,
        "response_fields": list(_FINAL_FIELDS),
    }
    if plan.n > 1:
        body["n_cmpl"] = plan.n
    if seed is not None:
        body["seed"] = seed
    k = params.get("logprobs")
    if k is not None:
        body["n_probs"] = max(k, 1)  # (0: the sampled token's logprob only)
    constraint = request.constraint
    if constraint is not None:
        if constraint.prefix or constraint.suffix or constraint.repeat:
            raise refuse(
                "constrains output to one JSON value (json_schema), not text around it",
                constraint.param,
            )
        if request.replayed_tokens:
            raise EngineError(
                "a constrained request cannot continue on another llama-server: its grammar "
                "starts at the first generated token, not after the replayed output",
                request_id=request_id,
            )
        body["json_schema"] = dict(constraint.json_schema or {"type": "object"})
    return LlamaCall(COMPLETION, body, plan)


@final
class LlamaReader:
    """llama-server's chunks as EngineOutputs, one per token per choice."""

    __slots__ = (
        "_budget", "_cached", "_gaps", "_k", "_open", "_request_id", "_seen", "done", "generated"
    )  # fmt: skip

    def __init__(
        self,
        n: int,
        logprobs: int | None,
        request_id: str,
        gaps: GapFiller | None,
        budget: int | None = None,
    ) -> None:
        self._open = set(range(n))
        self._budget = budget  # tokens per choice; None: llama-server's own limit
        self._seen = [0] * n  # ids received per choice (left-out ones included, once filled)
        self._k = logprobs
        self._request_id = request_id
        self._gaps = gaps
        self._cached: int | None = None
        #: every choice finished: nothing more to read
        self.done = False
        #: tokens received so far, over all choices
        self.generated = 0

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens llama-server reused from its cache (None: not said yet)."""
        return self._cached

    def feed(self, event: dict[str, Any]) -> list[EngineOutput]:
        """The output of one chunk (none for its start-of-stream and progress chunks).

        Raises:
            StreamDisconnected: an error event of the server's, a chunk for no choice.
            InvalidRequest: the server refused the request mid-stream (a 4xx error event).
            EngineError: a stop llama-server does not explain, or logprobs it left out.
        """
        if "error" in event:
            raise mid_stream(event, self._request_id)
        index = event.get("index", 0)
        if not isinstance(index, int) or not 0 <= index < len(self._seen):
            raise StreamDisconnected(
                f"llama-server sent a chunk for choice {index!r}", request_id=self._request_id
            )
        if index not in self._open:
            return []  # (cut at its budget already: what llama-server sends after is ignored)
        if event.get("stop") is True:
            return [self._finish(index, event.get("stop_type"))]
        ids = event.get("tokens") or []
        if not ids:
            return []
        predicted = event.get("tokens_predicted")
        missing = predicted - self._seen[index] - len(ids) if isinstance(predicted, int) else 0
        if missing > 0:
            ids = [*self._fill(event, ids, missing), *ids]
        finish: FinishReason | None = None
        budget = self._budget
        if budget is not None and self._seen[index] + len(ids) >= budget:
            ids = ids[: budget - self._seen[index]]
            finish = "length"
            self._open.discard(index)
            self.done = not self._open
        self._seen[index] += len(ids)
        self.generated += len(ids)
        output = EngineOutput(list(ids), None, None, finish, index)
        if self._k is not None:
            values, tops = self._logprobs(event, len(event.get("tokens") or ()))
            output.logprobs, output.top_logprobs = values[: len(ids)], tops[: len(ids)]
        if index == 0 and self._cached is None:
            timings = event.get("timings")
            cached = timings.get("cache_n") if isinstance(timings, dict) else None
            self._cached = cached if isinstance(cached, int) else 0
            output.cached_tokens = self._cached
        return [output]

    def end(self) -> list[EngineOutput]:
        """Nothing: the stream ended. Raises StreamDisconnected if a choice never finished."""
        if self._open:
            raise StreamDisconnected(
                f"llama-server's stream ended before choices {sorted(self._open)} finished",
                request_id=self._request_id,
            )
        return []

    def _finish(self, index: int, stop_type: Any) -> EngineOutput:
        finish = _FINISH.get(stop_type) if isinstance(stop_type, str) else None
        if finish is None:
            raise EngineError(
                f"llama-server stopped choice {index} with stop_type {stop_type!r}",
                request_id=self._request_id,
            )
        self._open.discard(index)
        self.done = not self._open
        return EngineOutput([], None, None, finish, index)

    def _fill(self, event: dict[str, Any], ids: list[int], missing: int) -> list[int]:
        if self._k is not None:
            raise EngineError(
                "llama-server reports no logprobs for a token that ends inside a character, "
                f"and left out {missing} (ask without logprobs, or use a vLLM upstream)",
                request_id=self._request_id,
            )
        content = event.get("content")
        filled = None
        if self._gaps is not None and isinstance(content, str) and len(ids) == 1:
            filled = self._gaps.fill(content, ids[0], missing)
        if filled is None:
            raise EngineError(
                f"llama-server left {missing} token id(s) out of its stream, which cannot be "
                f"recovered from its text {content!r}",
                request_id=self._request_id,
            )
        return filled

    def _logprobs(self, event: dict[str, Any], count: int) -> tuple[list[float], list[TopLogprobs]]:
        probabilities = event.get("completion_probabilities")
        if not isinstance(probabilities, list) or len(probabilities) != count:
            raise EngineError(
                "llama-server's logprobs do not align with its tokens", request_id=self._request_id
            )
        k = self._k or 0
        values = [float(entry["logprob"]) for entry in probabilities]
        tops = [
            [(int(c["id"]), float(c["logprob"])) for c in entry.get("top_logprobs") or ()][:k]
            for entry in probabilities
        ]
        return values, tops
