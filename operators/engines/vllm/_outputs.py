"""vLLM's ``RequestOutput`` deltas as :class:`~operators.contracts.llm.EngineOutput` steps.

One ``RequestOutput`` may carry several choices (``n > 1``), and several steps of one choice
when the request's task fell behind vLLM's output handler (it merges deltas); each choice
present becomes one EngineOutput. Logprobs are vLLM's per position: a dict from token id
to ``Logprob(logprob, rank)`` holding the sampled token and the ``k`` best (rank 1..k); the
sampled token's entry is its logprob, the entries ranked 1..k are the alternatives.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from operators.contracts.llm import EngineOutput, FinishReason, TopLogprobs
from pipeline import EngineError

__all__ = ("FINISH_REASONS", "engine_outputs", "logprobs_of")

#: vLLM's finish reasons that end a choice normally (others, "abort" and "error", fail it)
FINISH_REASONS: Final[Mapping[str, FinishReason]] = {"stop": "stop", "length": "length"}


def logprobs_of(
    token_ids: Sequence[int], positions: Sequence[Mapping[int, Any] | None], k: int
) -> tuple[list[float], list[TopLogprobs]]:
    """The sampled tokens' logprobs and the ``k`` best alternatives at each position."""
    sampled: list[float] = []
    tops: list[TopLogprobs] = []
    for token, position in zip(token_ids, positions, strict=True):
        if not position:
            raise EngineError(f"vLLM sent no logprobs for token {token}")
        sampled.append(float(position[token].logprob))
        ranked = sorted(
            (entry.rank, token_id, entry.logprob)
            for token_id, entry in position.items()
            if entry.rank is not None and entry.rank <= k
        )
        tops.append([(token_id, float(logprob)) for _, token_id, logprob in ranked])
    return sampled, tops


def engine_outputs(output: Any, *, logprobs: int | None, request_id: str) -> Iterator[EngineOutput]:
    """The EngineOutputs of one ``RequestOutput`` (a delta), in choice order.

    Raises:
        EngineError: vLLM ended a choice other than by a stop or its length (it aborted
            it: its engine is shutting down, or it ran out of KV cache for good).
    """
    for completion in output.outputs:
        reason = completion.finish_reason
        finish: FinishReason | None = None
        if reason is not None:
            mapped = FINISH_REASONS.get(reason)
            if mapped is None:
                raise EngineError(
                    f"vLLM ended choice {completion.index} with {reason!r}",
                    request_id=request_id,
                )
            finish = mapped
        ids = list(completion.token_ids)
        if logprobs is None or not ids:
            yield EngineOutput(ids, None, None, finish, completion.index)
        else:
            values, tops = logprobs_of(ids, completion.logprobs or (), logprobs)
            yield EngineOutput(ids, values, tops, finish, completion.index)
