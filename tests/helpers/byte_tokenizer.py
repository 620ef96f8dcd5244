"""A byte-level test tokenizer: any split of any UTF-8 text into tokens, ids made on demand.

Real byte-level BPE splits multi-byte characters across tokens; this double lets property
tests choose the split points freely (including inside a character) while keeping the
decoding rules of the real thing: a token's text appears once its character is complete.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ("ByteTokenizer", "reference_text")


class _Decoder:
    __slots__ = ("_decoder", "_vocab")

    def __init__(self, vocab: list[bytes]) -> None:
        self._vocab = vocab
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def step(self, token_id: int) -> str | None:
        text = self._decoder.decode(self._vocab[token_id])
        return text or None


class ByteTokenizer:
    """Token ids for byte strings; id 0 is EOS (empty text), id 1 a spare special token."""

    EOS = 0
    SPECIAL = 1

    def __init__(self) -> None:
        self._vocab: list[bytes] = [b"", b""]
        self._ids: dict[bytes, int] = {}

    def id_for(self, piece: bytes) -> int:
        token_id = self._ids.get(piece)
        if token_id is None:
            token_id = self._ids[piece] = len(self._vocab)
            self._vocab.append(piece)
        return token_id

    def tokenize(self, pieces: Sequence[bytes]) -> list[int]:
        return [self.id_for(piece) for piece in pieces]

    def piece(self, token_id: int) -> bytes:
        return self._vocab[token_id]

    def decode_stream(
        self, *, skip_special_tokens: bool, prompt_ids: Sequence[int] = ()
    ) -> _Decoder:
        return _Decoder(self._vocab)

    def decode(self, ids: Sequence[int]) -> str:
        return reference_text(b"".join(self._vocab[i] for i in ids))


def reference_text(data: bytes) -> str:
    """Decode ``data``, dropping an incomplete character at the very end (never U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    return decoder.decode(data)
