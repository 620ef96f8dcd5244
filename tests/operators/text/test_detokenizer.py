"""Tests for operators.text.detokenizer.

Why these tests: ByteLevelDecoder replaces DecodeStream on the per-token hot path on the claim
that, for a tokenizer whose decoder is exactly ByteLevel, it returns the same thing step for
step. That claim rests on facts about tokenizers' Rust code (module docstring), so each fact is
checked against the installed library (Python's lossy UTF-8 is Rust's; a token's bytes are
what decode uses, for every id of the shipped vocabulary), and then the whole claim is checked
as a property: random id sequences (biased towards split characters, invalid bytes, U+FFFD,
special, added and unknown tokens), random prompt prefill and flushes, both
skip_special_tokens values, compared with StreamDecoder (the DecodeStream wrapper) result for
result. The edge cases the brief names are also plain tests with their expected values.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from operators.text.detokenizer import (
    ByteLevelDecoder,
    ByteLevelVocabulary,
    IncrementalDecoder,
    StreamDecoder,
    byte_level_alphabet,
    has_byte_level_decoder,
)
from operators.text.tokenizer import Tokenizer

EMOJI = "🥳"  # three SmolLM2 tokens: F0 9F | A5 | B3
GENUINE_FFFD = 24211  # SmolLM2's token "ï¿½": the character U+FFFD itself
FLUSH = None  # in an op list: call flush() instead of step()
_SURROGATES: Final[tuple[Literal["Cs"]]] = ("Cs",)

Op = int | None


def smollm2() -> Tokenizer:
    return Tokenizer.default()


@functools.cache
def custom() -> Tokenizer:
    """SmolLM2 plus a normalizer and awkward added tokens, still with a plain ByteLevel decoder.

    * ``<Tool> X``: its space is not in the byte alphabet, so decode uses its UTF-8 as it is;
    * ``ĠÉé`` (normalized): decode sees the lower-cased ``ġéé`` = bytes 7F E9 E9, invalid UTF-8;
    * ``<|SPEC|>`` (special, normalized): decode sees ``<|spec|>``, which is not a special
      token's text, so skip_special_tokens does not skip it (a tokenizers quirk to mirror);
    * ``<|Ã|>`` (special): bytes 3C 7C C3 7C 3E, an invalid byte inside a special token;
    * ``ÃŁÃ``: bytes C3 9F C3 = "ß" and the first half of another character.
    """
    inner = tokenizers.Tokenizer.from_str(smollm2().inner.to_str())
    inner.normalizer = normalizers.Lowercase()
    inner.add_tokens(
        [
            AddedToken("<Tool> X", special=False, normalized=False),
            AddedToken("ĠÉé", special=False, normalized=True),
            AddedToken("ÃŁÃ", special=False, normalized=False),
        ]
    )
    inner.add_special_tokens(
        [
            AddedToken("<|SPEC|>", special=True, normalized=True),
            AddedToken("<|Ã|>", special=True, normalized=False),
        ]
    )
    return Tokenizer(inner)


def run(decoder: IncrementalDecoder, ops: Sequence[Op]) -> list[str | None]:
    return [decoder.flush() if op is None else decoder.step(op) for op in ops]


def both(
    tokenizer: Tokenizer, ops: Sequence[Op], *, skip: bool, prompt_ids: list[int] | None = None
) -> list[str | None]:
    """The results of the fast decoder, checked to equal DecodeStream's, with a final flush."""
    prompt = prompt_ids or []
    fast = tokenizer.decode_stream(skip_special_tokens=skip, prompt_ids=prompt)
    assert isinstance(fast, ByteLevelDecoder)
    reference = StreamDecoder(tokenizer.inner, skip_special_tokens=skip, prompt_ids=prompt)
    ops = [*ops, FLUSH]
    got = run(fast, ops)
    assert got == run(reference, ops), ops
    return got


# ------------------------------------------------------------------ the facts it rests on


def test_the_shipped_tokenizers_decoder_is_plain_byte_level() -> None:
    assert has_byte_level_decoder(smollm2().inner)
    assert isinstance(smollm2().decode_stream(skip_special_tokens=True), ByteLevelDecoder)
    assert isinstance(custom().decode_stream(skip_special_tokens=False), ByteLevelDecoder)


def _tiny(decoder: decoders.Decoder | None) -> Tokenizer:
    inner = tokenizers.Tokenizer(models.BPE(vocab={"▁a": 0, "b": 1}, merges=[]))
    if decoder is not None:
        inner.decoder = decoder
    return Tokenizer(inner)


@pytest.mark.parametrize(
    "decoder",
    [
        None,
        decoders.Metaspace(),
        decoders.Sequence([decoders.ByteLevel()]),
        decoders.ByteFallback(),
        decoders.WordPiece(),
    ],
    ids=["none", "metaspace", "sequence-of-byte-level", "byte-fallback", "wordpiece"],
)
def test_other_decoders_keep_decode_stream(decoder: decoders.Decoder | None) -> None:
    tokenizer = _tiny(decoder)
    stream = tokenizer.decode_stream(skip_special_tokens=False, prompt_ids=[0])
    assert isinstance(stream, StreamDecoder)
    reference = StreamDecoder(tokenizer.inner, skip_special_tokens=False, prompt_ids=[0])
    assert run(stream, [0, 1, 0, FLUSH]) == run(reference, [0, 1, 0, FLUSH])
    with pytest.raises(ValueError, match="exactly ByteLevel"):
        ByteLevelVocabulary(tokenizer.inner, skip_special_tokens=False)


def test_byte_level_alphabet_is_tokenizers_alphabet() -> None:
    alphabet = byte_level_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(alphabet.values()) == list(range(256))
    # Every byte that occurs in UTF-8 text: the pre-tokenizer maps it to the same character.
    to_char = {byte: char for char, byte in alphabet.items()}
    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for code_point in itertools.chain(range(0x800), range(0xE000, 0x10000, 7), [0x10FFFF]):
        text = chr(code_point)
        expected = "".join(to_char[byte] for byte in text.encode("utf-8"))
        assert splitter.pre_tokenize_str(text)[0][0] == expected


_TO_CHAR = {byte: char for char, byte in byte_level_alphabet().items()}
_BYTE_LEVEL = decoders.ByteLevel()


def _rust_lossy(data: bytes) -> str:
    """``String::from_utf8_lossy`` of ``data``, through tokenizers' own ByteLevel decoder."""
    text: str = _BYTE_LEVEL.decode(["".join(_TO_CHAR[byte] for byte in data)])
    return text


def test_python_lossy_utf8_is_rusts_for_every_one_and_two_byte_string() -> None:
    for length in (1, 2):
        for data in itertools.product(range(256), repeat=length):
            raw = bytes(data)
            assert raw.decode("utf-8", "replace") == _rust_lossy(raw), raw


_TRICKY_BYTES = st.sampled_from(
    [
        *(0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBD, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF),
        *(0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF1, 0xF4, 0xF5, 0xF8, 0xFF),
    ]
)


@settings(max_examples=500)
@given(data=st.one_of(st.binary(max_size=12), st.lists(_TRICKY_BYTES, max_size=12).map(bytes)))
def test_python_lossy_utf8_is_rusts(data: bytes) -> None:
    assert data.decode("utf-8", "replace") == _rust_lossy(data)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("which", ["smollm2", "custom"])
def test_every_tokens_bytes_are_what_decode_uses(which: str, skip: bool) -> None:
    tokenizer = smollm2() if which == "smollm2" else custom()
    inner = tokenizer.inner
    vocabulary = ByteLevelVocabulary(inner, skip_special_tokens=skip)
    size = tokenizer.vocab_size
    for token_id in range(size + 2):
        piece = vocabulary.piece(token_id)
        text = inner.decode([token_id], skip_special_tokens=skip)
        assert piece.decode("utf-8", "replace") == text, token_id
        cached = vocabulary.texts.get(token_id)
        if cached is not None:
            assert cached == text
            assert not text.endswith("\ufffd")
        else:
            assert not piece or "\ufffd" in text
    # Concatenation is what decode does (it is not a per-token join): emoji pieces.
    ids = tokenizer.encode(EMOJI * 2)
    assert b"".join(vocabulary.piece(i) for i in ids).decode() == inner.decode(ids) == EMOJI * 2


# -------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("skip", [False, True])
def test_split_characters(skip: bool) -> None:
    tokenizer = smollm2()
    assert both(tokenizer, tokenizer.encode(EMOJI), skip=skip) == [None, None, EMOJI, ""]
    assert both(tokenizer, tokenizer.encode("你好"), skip=skip) == [None, "你", None, "好", ""]
    assert both(tokenizer, tokenizer.encode("a 🥳🥳 b"), skip=skip) == [
        "a",
        *(None, None, " 🥳"),
        *(None, None, "🥳"),
        " b",
        "",
    ]


def test_invalid_utf8() -> None:
    tokenizer = smollm2()
    a = tokenizer.encode("a")[0]
    lead, cont = 142, 115  # "Ã" = byte C3 (a lead byte), "¥" = byte A5 (a continuation byte)
    emoji = tokenizer.encode(EMOJI)  # F0 9F | A5 | B3
    # A continuation byte alone is invalid at once, but DecodeStream still holds U+FFFD back.
    assert both(tokenizer, [cont, a], skip=False) == [None, "\ufffda", ""]
    # A character cut short by ASCII: one U+FFFD for the whole cut sequence.
    assert both(tokenizer, [emoji[0], a], skip=False) == [None, "\ufffda", ""]
    assert both(tokenizer, [lead, lead, a, lead], skip=False) == [
        None,
        None,
        "\ufffd\ufffda",
        None,
        "\ufffd",
    ]
    # Invalid bytes, then a whole emoji split over three tokens, then ASCII.
    assert both(tokenizer, [cont, *emoji, a], skip=False) == [
        None,
        None,
        None,
        "\ufffd" + EMOJI,
        "a",
        "",
    ]
    # A character cut short by the start of another one.
    assert both(tokenizer, [*emoji[:2], *emoji], skip=True) == [
        None,
        None,
        None,
        None,
        "\ufffd" + EMOJI,
        "",
    ]


@pytest.mark.parametrize("skip", [False, True])
def test_special_tokens(skip: bool) -> None:
    tokenizer = smollm2()
    ids = tokenizer.encode("<|im_start|>Hi<|im_end|>")
    assert both(tokenizer, ids, skip=skip) == [
        None if skip else "<|im_start|>",
        "Hi",
        None if skip else "<|im_end|>",
        "",
    ]


def test_skipped_special_token_inside_a_character() -> None:
    tokenizer = smollm2()
    emoji = tokenizer.encode(EMOJI)
    got = both(tokenizer, [emoji[0], 2, *emoji[1:]], skip=True)
    assert got == [None, None, None, EMOJI, ""]


def test_special_token_inside_a_character_when_not_skipped() -> None:
    """Unskipped, the special token's bytes cut the character short."""
    tokenizer = smollm2()
    emoji = tokenizer.encode(EMOJI)
    got = both(tokenizer, [emoji[0], 2, *emoji[1:]], skip=False)
    assert got == [None, "\ufffd<|im_end|>", None, None, "\ufffd\ufffd"]


@pytest.mark.parametrize("skip", [False, True])
def test_added_tokens(skip: bool) -> None:
    tokenizer = custom()
    tool, lowered, eszett, spec, broken = (
        tokenizer.token_to_id(text) for text in ("<Tool> X", "ĠÉé", "ÃŁÃ", "<|SPEC|>", "<|Ã|>")
    )
    assert None not in (tool, lowered, eszett, spec, broken)
    hi = tokenizer.encode("hi")[0]
    got = both(tokenizer, [tool, hi, lowered, hi, eszett, hi, spec, broken, hi], skip=skip)
    assert got == [
        "<Tool> X",
        "hi",
        None,
        "\x7f\ufffd\ufffdhi",
        None,
        "ß\ufffdhi",
        "<|spec|>",  # normalized special: decode does not recognise it as special
        None if skip else "<|\ufffd|>",
        "hi",
        "",
    ]


def test_unknown_ids_are_dropped_and_bad_ids_raise() -> None:
    tokenizer = smollm2()
    size = tokenizer.vocab_size
    emoji = tokenizer.encode(EMOJI)
    assert both(tokenizer, [size, emoji[0], size + 7, *emoji[1:]], skip=False) == [
        None,
        None,
        None,
        None,
        EMOJI,
        "",
    ]
    for bad in (-1, 2**32):
        with pytest.raises(TypeError):
            StreamDecoder(tokenizer.inner, skip_special_tokens=False).step(bad)
        with pytest.raises(TypeError):
            tokenizer.decode_stream(skip_special_tokens=False).step(bad)


@pytest.mark.parametrize("skip", [False, True])
def test_prompt_prefill(skip: bool) -> None:
    tokenizer = smollm2()
    hello = tokenizer.encode(" Hello there")
    for prompt in (
        tokenizer.encode("<|im_start|>assistant\n"),
        tokenizer.encode(EMOJI)[:2],  # ends inside a character
        tokenizer.encode("x " + EMOJI)[:-1],
        tokenizer.encode(EMOJI)[1:],  # starts inside a character
        [GENUINE_FFFD],  # ends with U+FFFD
        [tokenizer.encode(EMOJI)[0], 2],  # a cut character, then a special token
        [2, 2, 2],
        list(range(20)),
        [],
    ):
        assert both(tokenizer, hello, skip=skip, prompt_ids=prompt) == [" Hello", " there", ""]
        got = both(tokenizer, tokenizer.encode(EMOJI)[1:], skip=skip, prompt_ids=prompt)
        assert got == [None, None, "\ufffd\ufffd"]


@pytest.mark.parametrize("skip", [False, True])
def test_text_containing_u_fffd(skip: bool) -> None:
    tokenizer = smollm2()
    assert tokenizer.decode([GENUINE_FFFD]) == "\ufffd"
    a = tokenizer.encode("a")[0]
    assert both(tokenizer, [GENUINE_FFFD, a], skip=skip) == [None, "\ufffda", ""]
    assert both(tokenizer, [a, GENUINE_FFFD], skip=skip) == ["a", None, "\ufffd"]
    assert both(tokenizer, [GENUINE_FFFD, 2, GENUINE_FFFD, a], skip=skip) == [
        None,
        None if skip else "\ufffd<|im_end|>",
        None,
        "\ufffda" if not skip else "\ufffd\ufffda",
        "",
    ]
    assert tokenizer.encode("\ufffd") == [GENUINE_FFFD]
    # U+FFFD as three single-byte tokens: complete with the last one, and still held back.
    bytes_ef_bf_bd = [tokenizer.token_to_id(char) for char in "ï¿½"]
    assert both(tokenizer, bytes_ef_bf_bd, skip=skip) == [None, None, None, "\ufffd"]


def test_flush_mid_character_then_continue() -> None:
    tokenizer = smollm2()
    emoji = tokenizer.encode(EMOJI)
    x = tokenizer.encode("x")[0]
    ops: list[Op] = [emoji[0], FLUSH, FLUSH, x, *emoji[:2], FLUSH, emoji[2], x, FLUSH]
    assert both(tokenizer, ops, skip=False) == [
        None,
        "\ufffd",
        "",
        "x",
        None,
        None,
        "\ufffd",
        None,
        "\ufffdx",
        "",
        "",
    ]
    assert both(tokenizer, [2, FLUSH, emoji[0], 2, FLUSH], skip=True) == [
        None,
        "",
        None,
        None,
        "\ufffd",
        "",
    ]


def test_decoders_share_the_vocabulary_cache() -> None:
    tokenizer = smollm2()
    first = tokenizer.decode_stream(skip_special_tokens=False)
    second = tokenizer.decode_stream(skip_special_tokens=False)
    token_id = tokenizer.encode(" serendipitous")[0]
    first.step(token_id)
    assert isinstance(second, ByteLevelDecoder)
    assert second._vocabulary is first._vocabulary  # type: ignore[attr-defined]
    skipping = tokenizer.decode_stream(skip_special_tokens=True)
    assert skipping._vocabulary is not first._vocabulary  # type: ignore[attr-defined]


# ------------------------------------------------------------------------ the property


@dataclass(frozen=True)
class _Pools:
    partial: list[int]  # ids whose bytes are not complete UTF-8 (or end with U+FFFD)
    multibyte: list[int]  # complete non-ASCII characters
    special: list[int]
    added: list[int]  # every added token, special or not
    size: int


@functools.cache
def _pools(which: str) -> _Pools:
    tokenizer = smollm2() if which == "smollm2" else custom()
    vocabulary = ByteLevelVocabulary(tokenizer.inner, skip_special_tokens=False)
    partial, multibyte = [], []
    for token_id in range(tokenizer.vocab_size):
        piece = vocabulary.piece(token_id)
        if token_id not in vocabulary.texts:
            partial.append(token_id)
        elif not piece.isascii():
            multibyte.append(token_id)
    added_tokens = tokenizer.inner.get_added_tokens_decoder()
    special = sorted(token_id for token_id, token in added_tokens.items() if token.special)
    return _Pools(partial, multibyte, special, sorted(added_tokens), tokenizer.vocab_size)


def _ops(which: str) -> st.SearchStrategy[list[Op]]:
    pools = _pools(which)
    tokenizer = smollm2() if which == "smollm2" else custom()
    one_id = st.one_of(
        st.sampled_from(pools.partial),
        st.sampled_from(pools.partial),
        st.sampled_from(pools.multibyte),
        st.sampled_from(pools.special),
        st.sampled_from(pools.added[-8:]),  # custom(): the awkward ones
        st.just(GENUINE_FFFD),
        st.integers(0, pools.size - 1),
        st.integers(pools.size, pools.size + 3),  # unknown ids
    )
    texts = st.text(
        st.one_of(
            st.sampled_from("abc 🥳你好é\ufffd\n"),
            st.characters(exclude_categories=_SURROGATES),
        ),
        max_size=12,
    ).map(lambda text: tokenizer.encode(text, parse_special=False))
    chunk = st.one_of(
        one_id.map(lambda token_id: [token_id]),
        one_id.map(lambda token_id: [token_id]),
        texts,
        st.just([FLUSH]),
    )
    return st.lists(chunk, max_size=16).map(lambda chunks: [op for ops in chunks for op in ops])


def _prompts(which: str) -> st.SearchStrategy[list[int]]:
    return _ops(which).map(lambda ops: [op for op in ops if op is not None])


@settings(deadline=None, max_examples=400)
@given(ops=_ops("smollm2"), prompt=_prompts("smollm2"), skip=st.booleans())
def test_fast_decoder_equals_decode_stream(ops: list[Op], prompt: list[int], skip: bool) -> None:
    both(smollm2(), ops, skip=skip, prompt_ids=prompt)


@settings(deadline=None, max_examples=300)
@given(ops=_ops("custom"), prompt=_prompts("custom"), skip=st.booleans())
def test_fast_decoder_equals_decode_stream_with_added_tokens(
    ops: list[Op], prompt: list[int], skip: bool
) -> None:
    both(custom(), ops, skip=skip, prompt_ids=prompt)
