"""The token ids llama-server leaves out of its stream, recovered from its text.

llama-server streams a token only once its text is whole UTF-8: a character spelled in
several tokens (an emoji is three of SmolLM2's) arrives as one chunk carrying the whole
character's ``content`` but only the *last* token's id, while ``tokens_predicted`` counts
all of them (measured on llama.cpp 0c1e570, the one llama-cpp-python 0.3.36 vendors). The
engine contract wants every id, so the missing ones are rebuilt from the text:

1. the content's own encoding, when it is exactly the missing ids plus the id that came
   (what the model most often samples: how the tokenizer spells that character);
2. else a split of the content's bytes, less the last token's, into exactly that many
   vocabulary entries (longest first): the same text, the same count.

Either way the text and the count are right; only a model that spelled a character in an
unusual way gets other ids than it sampled (which matters to a replay after a migration,
and to nothing else). llama-server reports no logprobs for the left-out tokens either: a
request that asked for them fails there (``EngineError``) rather than receiving made-up
numbers.
"""

from __future__ import annotations

from typing import final

from operators.text.detokenizer import byte_level_alphabet
from operators.text.tokenizer import Tokenizer

__all__ = ("GapFiller",)


@final
class GapFiller:
    """Recovers left-out token ids with ``tokenizer`` (the served model's)."""

    __slots__ = ("_alphabet", "_by_bytes", "_longest", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._alphabet = byte_level_alphabet()
        self._by_bytes: dict[bytes, int] | None = None  # built on the first split
        self._longest = 0

    def fill(self, text: str, last: int, missing: int) -> list[int] | None:
        """The ``missing`` ids before ``last`` whose text, with ``last``'s, is ``text``;
        None when no such ids exist in the vocabulary."""
        encoded = self._tokenizer.encode(text, parse_special=False)
        if len(encoded) == missing + 1 and encoded[-1] == last:
            return encoded[:-1]
        tail = self._bytes(last)
        whole = text.encode()
        if tail is None or not whole.endswith(tail):
            return None
        return self._split(whole[: len(whole) - len(tail)], missing)

    def _bytes(self, token_id: int) -> bytes | None:
        token = self._tokenizer.id_to_token(token_id)
        if token is None:
            return None
        alphabet = self._alphabet
        if all(char in alphabet for char in token):
            return bytes(alphabet[char] for char in token)
        return token.encode()

    def _split(self, head: bytes, count: int) -> list[int] | None:
        """``head`` as exactly ``count`` vocabulary entries, longest first (None: impossible)."""
        by_bytes = self._vocabulary()
        longest = self._longest

        def search(start: int, left: int) -> list[int] | None:
            rest = len(head) - start
            if left == 0:
                return [] if rest == 0 else None
            if rest < left or rest > left * longest:
                return None
            for end in range(min(len(head), start + longest), start, -1):
                token = by_bytes.get(head[start:end])
                if token is None:
                    continue
                found = search(end, left - 1)
                if found is not None:
                    return [token, *found]
            return None

        return search(0, count)

    def _vocabulary(self) -> dict[bytes, int]:
        if self._by_bytes is None:
            vocabulary: dict[bytes, int] = {}
            vocab = self._tokenizer.inner.get_vocab(with_added_tokens=False)
            for token_id in vocab.values():
                piece = self._bytes(token_id)
                if piece:
                    vocabulary.setdefault(piece, token_id)
                    self._longest = max(self._longest, len(piece))
            self._by_bytes = vocabulary
        return self._by_bytes
