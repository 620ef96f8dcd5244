"""Encoding ASCII text for a byte-level BPE tokenizer without its Rust pre-tokenizer.

``tokenizers`` spends most of an ordinary prompt's encode time in its pre-tokenizer (the
GPT-2 split, an Oniguruma regex: ~170 µs of ~240 µs for a 160-token chat prompt here),
not in BPE. For ASCII text that split is a plain Python ``re`` (~30 µs), and BPE of a
pre-token does not depend on its neighbours, so each distinct pre-token is encoded once by
the tokenizer's own model and remembered::

    text --[added tokens split out]--> segments --[digits isolated]--> parts
         --[GPT-2 regex, ASCII classes]--> pre-tokens --[cache, else model.tokenize]--> ids

It applies only where it is exactly the tokenizer's own result: no normalizer, the
pre-tokenizer ``ByteLevel(add_prefix_space=False, use_regex=True)``, optionally after
``Digits(individual_digits=True)`` (SmolLM2's), a plain BPE model, added tokens without
``lstrip``/``rstrip``/``single_word`` (``add_special_tokens`` that adds BOS/EOS is left
to the tokenizer).
:meth:`AsciiEncoder.for_tokenizer` returns None for any other tokenizer, and
:meth:`AsciiEncoder.encode` returns None for text that is not ASCII; callers then use the
tokenizer itself. The tests compare both on random text.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, final

from .detokenizer import byte_level_alphabet

__all__ = ("AsciiEncoder", "decisive_config")

#: distinct pre-tokens remembered before the cache starts afresh
_CACHE_SIZE: Final = 100_000

# The GPT-2 split with its Unicode classes narrowed to ASCII. ``\s`` is spelled out:
# Python's ``\s`` also matches \x1c-\x1f, which are not white space for the Rust regex.
_WS: Final = r"\t\n\x0b\x0c\r "
_GPT2_ASCII: Final = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+"
    rf"|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
_DIGITS: Final = re.compile(r"([0-9])")


def decisive_config(inner: Any) -> dict[str, Any]:
    """The parts of the tokenizer's configuration that decide, in ``tokenizer.json`` form.

    Read piece by piece: serialising the whole tokenizer (vocabulary and merges) to JSON
    and parsing it back takes ~0.15 s, which the first request would wait for.
    """
    model = inner.model
    pre = inner.pre_tokenizer
    return {
        "normalizer": None if inner.normalizer is None else {"type": "present"},
        "pre_tokenizer": None if pre is None else json.loads(pre.__getstate__()),
        "model": {
            "type": type(model).__name__,
            "dropout": getattr(model, "dropout", None),
            "continuing_subword_prefix": getattr(model, "continuing_subword_prefix", None),
            "end_of_word_suffix": getattr(model, "end_of_word_suffix", None),
        },
        "added_tokens": [
            {
                "id": token_id,
                "content": token.content,
                "lstrip": token.lstrip,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
                "special": token.special,
            }
            for token_id, token in inner.get_added_tokens_decoder().items()
        ],
    }


def _isolates_digits(config: dict[str, Any]) -> bool:
    pre = config.get("pre_tokenizer") or {}
    return pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2


def _supported(config: dict[str, Any]) -> bool:
    if config.get("normalizer") is not None:
        return False
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps:
        return False
    *first, last = steps
    byte_level = (
        last.get("type") == "ByteLevel"
        and last.get("add_prefix_space") is False
        and last.get("use_regex", True) is True
    )
    digits = all(s.get("type") == "Digits" and s.get("individual_digits") for s in first)
    model = config.get("model") or {}
    plain_bpe = model.get("type") == "BPE" and not model.get("dropout")
    plain_bpe = plain_bpe and not model.get("continuing_subword_prefix")
    plain_bpe = plain_bpe and not model.get("end_of_word_suffix")
    added_plain = all(
        not (token.get("lstrip") or token.get("rstrip") or token.get("single_word"))
        for token in config.get("added_tokens") or ()
    )
    return byte_level and len(first) <= 1 and digits and plain_bpe and added_plain


@final
class AsciiEncoder:
    """Token ids of ASCII text, equal to ``tokenizer.encode(text).ids`` (see the module)."""

    __slots__ = (
        "_added",
        "_adds_special",
        "_cache",
        "_digits",
        "_model",
        "_split",
        "_translate",
    )

    def __init__(self, inner: Any, config: dict[str, Any]) -> None:
        self._model = inner.model
        self._translate = str.maketrans(
            {chr(byte): char for char, byte in byte_level_alphabet().items() if byte < 128}
        )
        self._cache: dict[str, tuple[int, ...]] = {}
        self._digits = _isolates_digits(config)
        #: whether ``add_special_tokens=True`` adds ids (BOS/EOS): those calls are declined
        self._adds_special = False
        added = {
            True: {t["content"]: t["id"] for t in config.get("added_tokens") or ()},
            False: {
                t["content"]: t["id"] for t in config.get("added_tokens") or () if not t["special"]
            },
        }
        self._added = added
        # Leftmost match, longest first at the same position, as tokenizers matches them.
        self._split = {
            parse: re.compile(
                "(" + "|".join(re.escape(c) for c in sorted(table, key=len, reverse=True)) + ")"
            )
            if table
            else None
            for parse, table in added.items()
        }

    @classmethod
    def for_tokenizer(cls, inner: Any) -> AsciiEncoder | None:
        """An encoder for ``inner`` (a ``tokenizers.Tokenizer``), or None if it does not apply."""
        config = decisive_config(inner)
        if not _supported(config):
            return None
        encoder = cls(inner, config)
        probe = "Hi 12"
        plain = inner.encode(probe, add_special_tokens=False).ids
        encoder._adds_special = inner.encode(probe, add_special_tokens=True).ids != plain
        return encoder

    def encode(
        self, text: str, *, parse_special: bool, add_special_tokens: bool = False
    ) -> list[int] | None:
        """The ids of ``text``, or None when it is not ASCII or the tokenizer would add
        special tokens (then ask the tokenizer)."""
        if add_special_tokens and self._adds_special:
            return None
        if type(text) is not str or not text.isascii():
            return None  # (anything else: the tokenizer answers, or raises its own error)
        ids: list[int] = []
        split = self._split[parse_special]
        if split is None:
            self._segment(text, ids)
            return ids
        added = self._added[parse_special]
        for i, part in enumerate(split.split(text)):
            if i % 2:
                ids.append(added[part])
            elif part:
                self._segment(part, ids)
        return ids

    def _segment(self, text: str, ids: list[int]) -> None:
        """Encode text holding no added token, appending to ``ids``."""
        cache = self._cache
        parts = _DIGITS.split(text) if self._digits else ["", "", text]
        for i, part in enumerate(parts):
            if i % 2:  # a digit: a pre-token of its own
                pieces = [part]
            elif part:
                pieces = _GPT2_ASCII.findall(part)
            else:
                continue
            for piece in pieces:
                found = cache.get(piece)
                if found is None:
                    if len(cache) >= _CACHE_SIZE:
                        cache.clear()
                    tokens = self._model.tokenize(piece.translate(self._translate))
                    found = cache[piece] = tuple(token.id for token in tokens)
                ids.extend(found)
