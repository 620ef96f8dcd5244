"""Per-sequence sampling in numpy: penalties, stop-id masking, a constraint's mask, greedy or
temperature + top_p.

Why numpy and not llama.cpp's sampler chain: the same code scores a plain decode step and
every row of a speculative verification, so greedy output is identical with and without
speculation, and a seeded request is reproducible whatever else shares its batch (each
choice owns its generator). Logprobs are computed only for the sequences that ask.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any, Final, Protocol, final

from operators.contracts.llm import PreprocessedRequest, TopLogprobs

try:
    import numpy as np
except ImportError:  # the [llama] extra is missing: LlamaEngine() says so before any use
    pass

if TYPE_CHECKING:
    from numpy.typing import NDArray

    Row = NDArray[np.float32]

__all__ = ("NO_TOKEN", "Allowed", "Sampler", "choice_generator", "logprobs_of", "nucleus")

#: what :meth:`Sampler.choose` returns when a constraint allows no token at all
NO_TOKEN: Final = -1

#: candidates examined first when cutting the top_p nucleus (grown until it holds top_p)
_NUCLEUS_FIRST: Final = 64


class Allowed(Protocol):
    """Which tokens may come next (a constraint's matcher, :class:`._constraint.Matcher`)."""

    def allowed(self) -> NDArray[np.bool_]:
        """One flag per token id: the mask."""
        ...


def choice_generator(seed: int | None, index: int) -> np.random.Generator:
    """The random generator of choice ``index`` of a request seeded with ``seed``.

    One per choice, so a choice's tokens do not depend on how its siblings' steps
    interleave with it (they run side by side, and may start at different times when slots
    are short). Choice 0 draws exactly what ``default_rng(seed)`` would, as before batching.
    ``None`` gives fresh entropy.
    """
    if seed is None:
        return np.random.default_rng()
    spawn_key = (index,) if index else ()
    return np.random.default_rng(np.random.SeedSequence(seed % 2**64, spawn_key=spawn_key))


@final
class Sampler:
    """Turns one row of logits into a token: penalties, stop-id suppression, then greedy or
    temperature + top_p sampling with the choice's own seeded generator."""

    __slots__ = (
        "_counts",
        "_frequency",
        "_presence",
        "_rng",
        "_temperature",
        "_top_k",
        "_top_p",
        "greedy",
    )

    def __init__(self, request: PreprocessedRequest, rng: np.random.Generator | None) -> None:
        sampling = request.sampling
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        self.greedy = temperature <= 0.0
        self._temperature = temperature
        self._top_p = 1.0 if sampling.top_p is None else sampling.top_p
        self._top_k = sampling.top_k or 0
        self._presence = sampling.presence_penalty or 0.0
        self._frequency = sampling.frequency_penalty or 0.0
        self._rng = rng
        # Penalties count this choice's output; on a migration retry that includes the
        # output replayed at the end of the prompt.
        replayed = request.replayed_tokens
        tail = request.token_ids[len(request.token_ids) - replayed :] if replayed else ()
        self._counts: Counter[int] = Counter(tail)

    def accept(self, token: int) -> None:
        self._counts[token] += 1

    def rng_state(self) -> dict[str, Any] | None:
        """The random generator's state, in JSON and msgpack types (its 128-bit numbers
        as hex strings), for another worker to continue the same draws; None when
        greedy."""
        if self.greedy or self._rng is None:
            return None
        state = self._rng.bit_generator.state
        if state.get("bit_generator") != "PCG64":
            return None
        inner = state["state"]
        return {
            "bit_generator": "PCG64",
            "state": f"{inner['state']:x}",
            "inc": f"{inner['inc']:x}",
            "has_uint32": int(state["has_uint32"]),
            "uinteger": int(state["uinteger"]),
        }

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Continue the draws of the generator whose :meth:`rng_state` this is.

        Raises:
            ValueError: not such a state.
        """
        if self.greedy:
            return
        try:
            bit_generator = np.random.PCG64()
            bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(state["state"], 16), "inc": int(state["inc"], 16)},
                "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"]),
            }
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a random generator state: {exc!r}") from None
        self._rng = np.random.Generator(bit_generator)

    def choose(
        self, row: Row, suppressed: NDArray[np.intp] | None, matcher: Allowed | None = None
    ) -> int:
        """The next token from ``row`` (not modified), never one of ``suppressed``, and one
        ``matcher`` allows.

        With a matcher the token is first chosen as if unconstrained and looked up in the
        mask; only when the mask refuses it is the mask applied to the logits (the costly
        part: a pass over the vocabulary in numpy) and the token chosen again among the
        allowed ones. For greedy decoding that is the allowed argmax; for sampling it is
        exactly the conditional distribution (the sampling distribution renormalized over
        the allowed tokens), since a draw that lands in the allowed set is kept with its
        own probability; only when top_p's nucleus holds no allowed token is the nucleus
        taken over the allowed tokens. :data:`NO_TOKEN` when the matcher allows nothing.
        """
        counts = self._counts
        penalize = bool(counts) and (self._presence != 0.0 or self._frequency != 0.0)
        if penalize or suppressed is not None:
            row = row.copy()
            if penalize:
                ids = np.fromiter(counts.keys(), dtype=np.intp, count=len(counts))
                seen = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                row[ids] -= seen * self._frequency + self._presence
            if suppressed is not None:
                row[suppressed] = -np.inf
        if self.greedy:
            token = int(np.argmax(row))
            if matcher is None:
                return token
            allowed = matcher.allowed()
            if allowed[token]:
                return token
            return self._greedy_allowed(row, allowed) if allowed.any() else NO_TOKEN
        ids_kept, weights = self._candidates(row)
        token = self._draw(weights, ids_kept)
        if matcher is None:
            return token
        allowed = matcher.allowed()
        if allowed[token]:
            return token
        if not allowed.any():
            return NO_TOKEN
        weights = weights * (allowed if ids_kept is None else allowed[ids_kept])
        if float(weights.sum()) > 0.0:
            return self._draw(weights, ids_kept)
        # The nucleus (or float64) holds no allowed token: sample the masked row instead.
        masked = np.where(allowed, row, -np.inf)
        if not np.isfinite(masked).any():  # only suppressed ids are allowed: the grammar wins
            masked = np.where(allowed, 0.0, -np.inf)
        ids_kept, weights = self._candidates(masked)
        return self._draw(weights, ids_kept)

    def _candidates(
        self, row: Row | NDArray[np.float64]
    ) -> tuple[NDArray[np.intp] | None, NDArray[np.float64]]:
        """The ids a draw may pick (None: every id) and their unnormalized weights: the
        ``top_k`` most likely, then ``top_p``'s nucleus of those, at the temperature."""
        size = len(row)
        top_k = self._top_k
        ids: NDArray[np.intp] | None = None
        if 0 < top_k < size:
            ids = np.argpartition(row, size - top_k)[size - top_k :]
            row = row[ids]
        weights = np.exp((row.astype(np.float64) - float(np.max(row))) / self._temperature)
        if self._top_p < 1.0:
            kept, weights = nucleus(weights, self._top_p)
            ids = kept if ids is None else ids[kept]
        return ids, weights

    @staticmethod
    def _greedy_allowed(row: Row, allowed: NDArray[np.bool_]) -> int:
        masked = np.where(allowed, row, -np.inf)
        token = int(np.argmax(masked))
        if np.isfinite(masked[token]):
            return token
        # Every allowed token is suppressed (a stop id before min_tokens): the grammar wins.
        return int(np.flatnonzero(allowed)[0])

    def _draw(self, weights: NDArray[np.float64], ids_kept: NDArray[np.intp] | None) -> int:
        cumulative = np.cumsum(weights)
        assert self._rng is not None
        draw = self._rng.random() * float(cumulative[-1])
        pick = min(int(np.searchsorted(cumulative, draw, side="right")), len(cumulative) - 1)
        return pick if ids_kept is None else int(ids_kept[pick])


def nucleus(
    weights: NDArray[np.float64], top_p: float
) -> tuple[NDArray[np.intp], NDArray[np.float64]]:
    """The smallest set of most likely ids holding ``top_p`` of the mass, best first."""
    size = len(weights)
    target = top_p * float(weights.sum())
    k = min(_NUCLEUS_FIRST, size)
    while True:
        ids = np.argpartition(weights, size - k)[size - k :] if k < size else np.arange(size)
        ids = ids[np.argsort(-weights[ids], kind="stable")]
        kept = weights[ids]
        cumulative = np.cumsum(kept)
        if cumulative[-1] >= target or k == size:
            cut = min(int(np.searchsorted(cumulative, target)) + 1, k)
            return ids[:cut], kept[:cut]
        k = min(k * 8, size)


def logprobs_of(row: Row, token: int, k: int) -> tuple[float, TopLogprobs]:
    """``token``'s log-probability under ``row`` and the ``k`` most likely alternatives."""
    shifted = row - np.max(row)
    log_total = math.log(float(np.exp(shifted).sum(dtype=np.float64)))
    top: TopLogprobs = []
    if k > 0:
        size = len(row)
        k = min(k, size)
        ids = np.argpartition(shifted, size - k)[size - k :]
        ids = ids[np.argsort(-shifted[ids], kind="stable")]
        top = [(int(i), float(shifted[i]) - log_total) for i in ids]
    return float(shifted[token]) - log_total, top
