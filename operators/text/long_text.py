"""Long prompt texts, tokenized piece by piece: the same ids, a bounded stall, bounded memory.

Why: ``tokenizers`` encodes a text in one Rust call that holds the GIL from start to end and
builds an ``Encoding`` of ~100 bytes per token (offsets, token strings, masks) before we take
its ids. A 2 MB prompt stalled every other request for over a second even from a worker
thread, and a 20 MB one peaked at 2.7 GB. Cut into pieces of :data:`PIECE_CHARS` characters,
the text costs one short call per piece (the loop thread gets the GIL between them), one
piece's ``Encoding`` at a time, and 8 bytes per id once every id refers to one shared ``int``.

The cuts are only where every split the tokenizer may make has a boundary anyway: just before
a single space that follows an ASCII letter or digit and precedes an ASCII letter (``"word
word"`` is cut as ``"word" | " word"``). GPT-2-style pre-tokenizers (``ByteLevel`` with its
regex, Llama-3 and Qwen ``Split`` patterns, ``Digits``) never merge across that point, and
BPE never merges across pre-tokens, so the ids of the pieces, concatenated, are the ids of
the text. :func:`splits_safely` says which tokenizers that holds for (no normalizer, no
prefix space, no added token containing a space or stripping its neighbours); the tests
compare both ways on random text. A text without such a place is one piece, as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = ("PIECE_CHARS", "pieces", "splits_safely")

#: the length of a piece: ~1k tokens of English, about a millisecond of encoding
PIECE_CHARS: Final = 4_096

_CUT: Final = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")
#: pre-tokenizers whose splits all have a boundary at a cut (with these settings)
_SAFE_STEPS: Final = frozenset({"ByteLevel", "Digits", "Split"})


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of about ``size`` characters (at least ``size`` except
    the last), cut only at the places described in the module; their concatenation is
    ``text``. Each search for a cut looks at ``size`` characters at a time."""
    start = 0
    end = len(text)
    while end - start > size:
        position = start + size
        found = None
        while found is None and position < end:
            found = _CUT.search(text, position, min(end, position + size + 1))
            position += size
        if found is None:
            break
        yield text[start : found.start()]
        start = found.start()
    yield text[start:]


def splits_safely(config: Mapping[str, Any]) -> bool:
    """Whether cutting at :func:`pieces`' places leaves the ids of a tokenizer unchanged.

    ``config`` is the tokenizer's configuration in ``tokenizer.json`` form (the parts
    :func:`operators.text.ascii_encoder.decisive_config` reads).
    """
    if config.get("normalizer") is not None:
        return False
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or (config.get("model") or {}).get("type") != "BPE":
        return False
    for step in steps:
        kind = step.get("type")
        if kind not in _SAFE_STEPS:
            return False
        if kind == "ByteLevel" and step.get("add_prefix_space") is not False:
            return False
        if kind == "Split" and step.get("behavior") not in ("Isolated", "Removed"):
            return False
    return all(
        " " not in token.get("content", "")
        and not (token.get("lstrip") or token.get("rstrip") or token.get("single_word"))
        for token in config.get("added_tokens") or ()
    )
