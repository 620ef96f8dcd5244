"""A migrated constrained request: its constraint, advanced past the replayed output.

vLLM's structured outputs match a grammar from the first *generated* token. After a
migration, the output the client already has is part of the prompt (``replayed_tokens``),
and the rest must still complete a valid answer: a grammar started afresh would force a
second ``{`` after the replayed ``{"city": "Pa``. vLLM offers no way to start its grammar
from a given output prefix, so a migrated constrained request goes through this logits
processor instead: the same Lark grammar (:func:`operators.engines._grammar.lark_grammar`)
compiled by the same llguidance, over the same view of the vocabulary as vLLM's "guidance"
backend, consumes the replayed tokens first (a mask, then a token, as a first attempt
advances), then masks each step's logits. A greedy retry therefore continues exactly as
the first attempt would have.

It runs in vLLM's engine-core process, which loads it by name (``logits_processors``);
requests that do not carry ``_sampling.EXTRA_ARG`` in ``SamplingParams.extra_args`` pay one dict
lookup when they join the batch. Nothing here may raise into vLLM's step (that would kill
the engine): a grammar that does not compile, or a replay it refuses, is logged and the
choice is ended with an end-of-sequence token.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

with warnings.catch_warnings():  # (torch's and vLLM's import-time deprecations)
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    try:
        import torch
        from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
    except ImportError:  # the [vllm] extra is missing: VllmEngine() says so; vLLM alone loads this
        AdapterLogitsProcessor = object

from ._sampling import EXTRA_ARG

if TYPE_CHECKING:
    import llguidance

__all__ = ("ReplayedConstraint",)

logger = logging.getLogger("operators.engines.vllm")


class ReplayedConstraint(AdapterLogitsProcessor):  # type: ignore[misc]
    """vLLM logits processor: masks a migrated constrained request's logits (see the
    module docstring). Built by vLLM once per engine, with its config."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._model_config = vllm_config.model_config
        self._tokenizer: llguidance.LLTokenizer | None = None

    def is_argmax_invariant(self) -> bool:
        """It changes which token is most likely: it applies to greedy requests too."""
        return False

    def new_req_logits_processor(self, params: Any) -> Callable[..., Any] | None:
        spec = (params.extra_args or {}).get(EXTRA_ARG)
        if spec is None:
            return None
        try:
            return self._step(spec)
        except Exception:  # never into vLLM's step: end the choice instead
            logger.exception("a replayed constraint could not be set up; ending the choice")
            return _end_of_sequence(self._eos())

    def _eos(self) -> int:
        tokenizer = self._ll_tokenizer()
        return int(tokenizer.eos_token)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as vLLM's guidance backend sees it (built once, ~0.5 s)."""
        if self._tokenizer is None:
            import llguidance.hf
            from vllm.tokenizers import cached_tokenizer_from_config

            hf_tokenizer = cached_tokenizer_from_config(model_config=self._model_config)
            vocab = max(self._model_config.get_vocab_size(), len(hf_tokenizer))
            self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, vocab)
        return self._tokenizer

    def _step(self, spec: Mapping[str, Any]) -> Callable[[list[int], Any], Any]:
        import llguidance

        tokenizer = self._ll_tokenizer()
        matcher = llguidance.LLMatcher(
            tokenizer, llguidance.grammar_from("grammar", spec["grammar"]), log_level=0
        )
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        mask = _Mask(tokenizer.vocab_size)
        for token in spec["replayed"]:
            mask.fill(matcher)
            if not mask.allows(token) or not matcher.consume_token(token):
                raise ValueError(f"the replayed output does not satisfy the grammar at {token}")
        consumed = 0

        def step(output_ids: list[int], logits: Any) -> Any:
            nonlocal consumed
            for token in output_ids[consumed:]:
                if not matcher.is_stopped():
                    matcher.consume_token(token)
            consumed = len(output_ids)
            mask.fill(matcher)  # only end-of-sequence once the grammar is complete
            return mask.apply(logits)

        return step


def _end_of_sequence(eos: int) -> Callable[[list[int], Any], Any]:
    def step(output_ids: list[int], logits: Any) -> Any:
        keep = logits[eos].clone()
        logits.fill_(float("-inf"))
        logits[eos] = keep
        return logits

    return step


class _Mask:
    """One request's token mask: llguidance's bitmask, unpacked into a torch bool row."""

    __slots__ = ("_allowed", "_bits", "_shifts", "_vocab")

    def __init__(self, vocab: int) -> None:
        self._vocab = vocab
        self._bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._allowed = torch.zeros(vocab, dtype=torch.bool)

    def fill(self, matcher: llguidance.LLMatcher) -> None:
        bits = self._bits
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())
        unpacked = (bits.unsqueeze(1) >> self._shifts) & 1
        self._allowed = unpacked.flatten()[: self._vocab].bool()

    def allows(self, token: int) -> bool:
        return 0 <= token < self._vocab and bool(self._allowed[token])

    def apply(self, logits: Any) -> Any:
        size = logits.shape[-1]
        vocab = min(size, self._vocab)
        logits[:vocab].masked_fill_(~self._allowed[:vocab], float("-inf"))
        if size > vocab:
            logits[vocab:] = float("-inf")
        return logits
