"""Incremental detokenization: generated ids -> text, one id at a time, never half a character.

Why this module exists: the Backend calls ``step`` once per generated token, so this is one of
the hottest loops of the serving graph. ``tokenizers.decoders.DecodeStream`` is correct for
every tokenizer but costs ~1.5 µs per token (it re-decodes a window of ids in Rust each step),
which profiled at ~15% of the in-process graph's per-token CPU. For the tokenizers this project
ships (byte-level BPE: SmolLM2, and every GGUF :meth:`~operators.text.tokenizer.Tokenizer.from_gguf`
converts) the same results can be had from a dictionary lookup, so there are two decoders
behind one interface:

* :class:`StreamDecoder` wraps ``DecodeStream``: any tokenizer (Metaspace, byte fallback,
  custom decoders...).
* :class:`ByteLevelDecoder`: tokenizers whose decoder is exactly ``decoders.ByteLevel``. It
  returns what :class:`StreamDecoder` returns, step for step, including ``None`` results, U+FFFD
  for invalid bytes and :meth:`~IncrementalDecoder.flush`; ~0.1 µs for an ordinary token.

Why the byte-level shortcut is exact (read from tokenizers' Rust source, 0.23, and checked by
the property tests in ``tests/operators/text/test_detokenizer.py``):

1. ``Tokenizer.decode(ids)`` with a ``ByteLevel`` decoder is ``String::from_utf8_lossy`` of the
   concatenated bytes of the tokens: a token's text (``id_to_token``: an added token's content,
   normalized when it is ``normalized=True``, else the model's vocabulary entry) maps through
   the GPT-2 byte alphabet when every character is in it, otherwise contributes its own UTF-8.
   Unknown ids, and special tokens under ``skip_special_tokens``, contribute nothing. Python's
   ``bytes.decode("utf-8", "replace")`` replaces exactly the same maximal invalid subparts.
2. ``DecodeStream`` returns text only when the decode of its window is longer than the text it
   returned last and does not end with U+FFFD. Lossy UTF-8 decoding that does not end with
   U+FFFD ended on a complete character, so the decoder is at a character boundary there and
   what follows decodes independently of what came before. Hence each result is the lossy
   decode of the bytes fed since the previous result, returned once that decode is non-empty and
   does not end with U+FFFD (a character cut short, invalid bytes, or a token whose own text
   ends with U+FFFD, all of which DecodeStream also holds back).
3. For the same reason the prompt context (``prompt_ids``) never changes a byte-level result:
   :class:`StreamDecoder` only adopts a context whose decode does not end with U+FFFD, i.e.
   one that ends on a character boundary.

So a token whose bytes are complete, valid UTF-8 not ending in U+FFFD, arriving with nothing
held back, yields its cached text; anything else goes through a small bytes buffer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Final, final

import tokenizers
from tokenizers import decoders

__all__ = (
    "ByteLevelDecoder",
    "ByteLevelVocabulary",
    "IncrementalDecoder",
    "StreamDecoder",
    "PROMPT_CONTEXT_IDS",
    "byte_level_alphabet",
    "has_byte_level_decoder",
)

#: How many trailing prompt ids prime a StreamDecoder (callers pass at most these). Decoders
#: such as Metaspace strip the leading space of the first token of a text; priming with
#: context that precedes the generated ids makes the first generated token decode exactly as
#: it does inside the full text.
PROMPT_CONTEXT_IDS: Final = 8

# DecodeStream takes ids as Rust u32.
_MAX_TOKEN_ID: Final = 2**32 - 1

_REPLACEMENT: Final = "\ufffd"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: vocabulary character -> the byte it stands for.

    The construction of ``bytes_char`` in tokenizers (``pre_tokenizers/byte_level.rs``) and of
    ``bytes_to_unicode`` in GPT-2's ``encoder.py``: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for U+0100 onwards, in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(byte): byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


_CHAR_BYTES: Final = byte_level_alphabet()

# Stands in for a ByteLevelDecoder's text cache while bytes are held back, so that the hot path
# needs no separate "is anything held back" test. Never written to.
_NO_TEXTS: Final[dict[int, str]] = {}


def has_byte_level_decoder(inner: tokenizers.Tokenizer) -> bool:
    """True if ``inner`` decodes with exactly ``decoders.ByteLevel`` (no Sequence, no custom).

    ByteLevel's decode ignores its options (add_prefix_space, trim_offsets, use_regex).
    Normalizers, pre-tokenizers and post-processors play no part in decoding, except through
    the normalized text of ``normalized=True`` added tokens, which ``id_to_token`` returns too.
    """
    return type(inner.decoder) is decoders.ByteLevel


class IncrementalDecoder(ABC):
    """Generated ids -> text, one id at a time, never splitting a multi-byte character.

    ``step`` returns None while the text is incomplete (the first bytes of an emoji or CJK
    character, or a special token skipped by ``skip_special_tokens``) and otherwise all text
    completed since the last non-None result. Joining every result, plus :meth:`flush` at the
    end, equals ``Tokenizer.decode`` of all generated ids. Get one from
    :meth:`operators.text.tokenizer.Tokenizer.decode_stream`, which picks the implementation.
    """

    __slots__ = ()

    @abstractmethod
    def step(self, token_id: int) -> str | None:
        """Feed one generated id; the newly completed text, or None if nothing completed."""

    @abstractmethod
    def flush(self) -> str:
        """Text held back at the end of generation ("" normally; U+FFFD for a cut character).

        Call once when generation stops (e.g. max_tokens reached in the middle of an emoji).
        The decoder starts afresh afterwards.
        """


@final
class StreamDecoder(IncrementalDecoder):
    """The general decoder: a thin wrapper over ``tokenizers.decoders.DecodeStream``.

    Correct for any tokenizer (~1-2 µs per id, in Rust). ``prompt_ids``: the prompt the
    generated ids continue; its last few ids give the decoder context (only the generated text
    is returned).
    """

    __slots__ = ("_inner", "_pending", "_skip_special_tokens", "_step")

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        skip_special_tokens: bool,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._inner = inner
        self._skip_special_tokens = skip_special_tokens
        # ids fed since the last non-None result (only touched on the rare None path).
        self._pending: list[int] = []
        prefill = list(prompt_ids[-PROMPT_CONTEXT_IDS:])
        # A prefill that ends inside a character would make DecodeStream re-emit the prompt
        # (it only adopts a prefix that does not end in U+FFFD); without it the continuation
        # bytes decode as U+FFFD, exactly as in decode(prompt + generated) minus the prompt.
        if prefill and inner.decode(prefill, skip_special_tokens=skip_special_tokens).endswith(
            _REPLACEMENT
        ):
            prefill = []
        stream = decoders.DecodeStream(ids=prefill or None, skip_special_tokens=skip_special_tokens)
        self._step = stream.step

    def step(self, token_id: int) -> str | None:
        text = self._step(self._inner, token_id)
        if text is None:
            self._pending.append(token_id)
        elif self._pending:
            self._pending.clear()
        return text

    def flush(self) -> str:
        if not self._pending:
            return ""
        text = self._inner.decode(self._pending, skip_special_tokens=self._skip_special_tokens)
        self._pending.clear()
        self._step = decoders.DecodeStream(skip_special_tokens=self._skip_special_tokens).step
        return text


@final
class ByteLevelVocabulary:
    """Token id -> the bytes it adds to a byte-level decode, for one tokenizer and one
    ``skip_special_tokens`` value; filled lazily and shared by every :class:`ByteLevelDecoder`.

    Lazily, because a request touches a few hundred of the vocabulary's ids and building all
    49k entries up front would cost ~0.1 s at start-up. The tokenizer must not be changed
    (decoder, added tokens) once a vocabulary has been made for it.
    """

    __slots__ = ("_inner", "_skip_special_tokens", "pieces", "texts")

    def __init__(self, inner: tokenizers.Tokenizer, *, skip_special_tokens: bool) -> None:
        if not has_byte_level_decoder(inner):
            raise ValueError(
                f"ByteLevelVocabulary needs a tokenizer whose decoder is exactly ByteLevel, "
                f"not {type(inner.decoder).__name__}; use StreamDecoder"
            )
        self._inner = inner
        self._skip_special_tokens = skip_special_tokens
        #: id -> its bytes (b"" for unknown ids and skipped special tokens), once seen.
        self.pieces: dict[int, bytes] = {}
        #: id -> its text, for ids whose bytes are complete UTF-8 not ending in U+FFFD.
        self.texts: dict[int, str] = {}

    def piece(self, token_id: int) -> bytes:
        """The bytes ``token_id`` contributes (computed once, then cached with its text)."""
        found = self.pieces.get(token_id)
        if found is not None:
            return found
        if not isinstance(token_id, int) or not 0 <= token_id <= _MAX_TOKEN_ID:
            # What DecodeStream raises for an id that is not a u32.
            raise TypeError(f"token ids are integers in [0, 2**32), not {token_id!r}")
        inner = self._inner
        token = inner.id_to_token(token_id)
        if token is None:  # unknown id: decode drops it
            piece = b""
        elif self._skip_special_tokens and not inner.decode([token_id], skip_special_tokens=True):
            # Skipped special token. Asking decode (not the added-token flags) mirrors exactly
            # which ids it skips: it matches special tokens by (possibly normalized) text.
            piece = b""
        elif all(char in _CHAR_BYTES for char in token):
            piece = bytes([_CHAR_BYTES[char] for char in token])
        else:  # e.g. an added token containing a space: decode keeps its UTF-8 as it is
            piece = token.encode("utf-8")
        self.pieces[token_id] = piece
        if piece:
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError:  # part of a character, or invalid bytes
                pass
            else:
                if not text.endswith(_REPLACEMENT):
                    self.texts[token_id] = text
        return piece


@final
class ByteLevelDecoder(IncrementalDecoder):
    """The fast decoder for byte-level tokenizers: same results as :class:`StreamDecoder`.

    Nothing held back and a token with complete text: one dictionary lookup. Otherwise the
    token's bytes join a buffer, returned (decoded, invalid bytes as U+FFFD) as soon as its
    decode does not end with U+FFFD. The module docstring says why this equals DecodeStream.
    No prompt context is needed (point 3 there).
    """

    __slots__ = ("_buffer", "_texts", "_vocabulary")

    def __init__(self, vocabulary: ByteLevelVocabulary) -> None:
        self._vocabulary = vocabulary
        self._buffer = b""  # bytes fed since the last non-None result
        # vocabulary.texts while the buffer is empty, else _NO_TEXTS (so step tests one thing).
        self._texts = vocabulary.texts

    def step(self, token_id: int) -> str | None:
        text = self._texts.get(token_id)
        if text is not None:
            return text
        return self._step_slow(token_id)

    def _step_slow(self, token_id: int) -> str | None:
        vocabulary = self._vocabulary
        piece = vocabulary.piece(token_id)
        if not piece:  # skipped special token or unknown id: no text, nothing changes
            return None
        buffer = self._buffer + piece if self._buffer else piece
        text = buffer.decode("utf-8", "replace")
        if text.endswith(_REPLACEMENT):
            self._buffer = buffer
            self._texts = _NO_TEXTS
            return None
        self._buffer = b""
        self._texts = vocabulary.texts
        return text

    def flush(self) -> str:
        text = self._buffer.decode("utf-8", "replace")
        self._buffer = b""
        self._texts = self._vocabulary.texts
        return text
