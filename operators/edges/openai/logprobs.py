"""Logprobs bookkeeping: which generated tokens have been delivered, and their texts and bytes.

Apart from chunk building (:mod:`.chunks`) because it answers a different question: not
"what does this chunk say" but "which tokens has the client seen by now". A hidden stop
string can hold text back, or swallow it, so a token's logprob leaves only once its text has
(``BackendOutput.delivered_tokens``), each once, in order (bug class B11,
``docs/bug-classes.md``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Final, Protocol

from operators.contracts.llm import BackendOutput, TopLogprobs
from operators.text.detokenizer import byte_level_alphabet

__all__ = ("ChoiceState", "Entry", "TokenDecoder", "TokenTexts")

# A generated token waiting for delivery: (token id, its text, logprob, alternatives), or
# None when the engine sent no logprob for it.
Entry = tuple[int, str, float, TopLogprobs | None] | int | None
"""A token's logprob record (id, text, logprob, alternatives); or, for a token without one
(its output carried no logprobs: an operator rewrote its text), None, except that the first
such token of an output is the length of that output's text, so completions' ``text_offset``
keeps counting the text the client read."""


class TokenDecoder(Protocol):
    """What :class:`TokenTexts` needs from a tokenizer."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...


_BYTE_LEVEL: Final = byte_level_alphabet()


class TokenTexts:
    """Token id -> (text, raw bytes) for logprobs, cached (one cache per tokenizer).

    ``text`` is the token decoded alone (U+FFFD for part of a character). ``raw`` is the
    token's exact bytes when the vocabulary is byte-level (GPT-2 style, as SmolLM2's) and
    they agree with ``text``, so a token holding half of an emoji reports that half;
    otherwise None, and callers fall back to the UTF-8 of a text.
    """

    __slots__ = ("_cache", "_tokenizer")

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes | None]] = {}

    def get(self, token_id: int) -> tuple[str, bytes | None]:
        """``(text, raw bytes or None)`` of ``token_id``."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, bytes | None]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self._tokenizer.id_to_token(token_id)
        if piece:
            table = _BYTE_LEVEL
            if all(char in table for char in piece):
                raw = bytes(table[char] for char in piece)
                if raw.decode("utf-8", "replace") == text:
                    return text, raw
        return text, None


class ChoiceState:
    """The backward-edge state of one choice."""

    __slots__ = (
        "echo",
        "emitted",
        "finish_reason",
        "finished",
        "index",
        "pending",
        "seen",
        "text_offset",
    )

    def __init__(self, index: int, echo: str = "") -> None:
        #: the choice's index in the response
        self.index = index
        #: True once its finish_reason went out
        self.finished = False
        #: the finish_reason that went out (None before)
        self.finish_reason: str | None = None
        #: completions ``echo``: text still to put in front of the first chunk
        self.echo = echo
        #: logprob entries of generated tokens not yet delivered, in generation order
        self.pending: deque[Entry] = deque()
        self.seen = 0  # tokens generated
        self.emitted = 0  # tokens delivered (their logprobs went out)
        self.text_offset = 0  # completions: characters of token text before the next token

    def delivered(self, output: BackendOutput) -> list[Entry]:
        """Take ``output``'s tokens in; return the entries delivered by now, in order.

        ``output.delivered_tokens`` counts this choice's tokens whose text has reached the
        client; tokens past it wait here, and those a hidden stop swallowed never leave.
        """
        pending = self.pending
        ids = output.token_ids
        count = len(ids)
        logprobs = output.logprobs
        if logprobs is None:
            if count:
                pending.append(len(output.text))
                pending.extend([None] * (count - 1))
        else:
            tokens = output.tokens
            top = output.top_logprobs
            for i in range(count):
                pending.append((ids[i], tokens[i], logprobs[i], None if top is None else top[i]))
        self.seen += count
        ready = min(output.delivered_tokens, self.seen) - self.emitted
        if ready <= 0:
            return []
        self.emitted += ready
        return [pending.popleft() for _ in range(ready)]
