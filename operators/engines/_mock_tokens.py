"""What the mocker generates: deterministic token ids, logprobs and encoder results.

Apart from :class:`~operators.engines.mocker.MockerEngine` because none of it depends on
time or on the step clock: every output is a function of the request alone, which is what
lets a migration retry, a prefill/decode handoff or a second worker continue the very
sequence the first one started.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterable, Iterator
from typing import Any, Final, Literal, final

from operators.contracts.llm import PreprocessedRequest, TopLogprobs

from ._transfer_handle import digest

__all__ = ("RANDOM_IDS", "TokenSource", "embeddings", "top_logprobs")

#: "random" tokens are drawn from this id range
RANDOM_IDS: Final = (256, 4096)


@final
class TokenSource:
    """The tokens of a request's answer: the prompt echoed (``"echo"``, cycling, special ids
    left out) or ids drawn from a generator seeded by ``seed`` and the prompt
    (``"random"``; also for an echo of a prompt that is all special ids)."""

    __slots__ = ("_seed", "_special", "kind")

    def __init__(self, kind: Literal["echo", "random"], seed: int, special: Iterable[int]) -> None:
        self.kind = kind
        self._seed = seed
        self._special = frozenset(special)

    def at(self, request: PreprocessedRequest, position: int) -> int:
        """The token at ``position`` of the answer (0: the first output token)."""
        return next(self.sequence(request, position))

    def sequence(self, request: PreprocessedRequest, start: int) -> Iterator[int]:
        """The answer's tokens from ``position`` ``start`` on, without end."""
        prompt = request.token_ids[: request.prompt_tokens]
        if self.kind == "echo":
            special = self._special
            echo = [token_id for token_id in prompt if token_id not in special]
            if echo:
                period = len(echo)
                return (echo[i % period] for i in itertools.count(start))
        return self._random(prompt, start)

    def _random(self, prompt: list[int], start: int) -> Iterator[int]:
        rng = random.Random(f"{self._seed}:{digest(prompt)}")
        low, high = RANDOM_IDS
        special = self._special
        position = 0
        while True:
            token_id = rng.randrange(low, high)
            if token_id in special:
                continue
            if position >= start:
                yield token_id
            position += 1


def embeddings(request: PreprocessedRequest) -> list[dict[str, Any]]:
    """What an encode worker returns for each of the request's multimodal items."""
    return [
        {
            "index": index,
            "digest": hashlib.sha256(item.data).hexdigest()[:16],
            "mime_type": item.mime_type,
        }
        for index, item in enumerate(request.multimodal)
    ]


def top_logprobs(token_id: int, logprob: float, k: int) -> TopLogprobs:
    """The sampled token first, then ``k`` deterministic less likely alternatives."""
    return [(token_id, logprob), *((token_id + rank, logprob - rank) for rank in range(1, k + 1))]
