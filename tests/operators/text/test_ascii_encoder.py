"""The ASCII fast path gives exactly the tokenizer's own ids, or declines."""

from __future__ import annotations

import string

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.text.ascii_encoder import AsciiEncoder
from operators.text.tokenizer import Tokenizer

INNER = Tokenizer.default()._inner
ENCODER = AsciiEncoder.for_tokenizer(INNER)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def reference(text: str, *, parse_special: bool) -> list[int]:
    previous = INNER.encode_special_tokens
    INNER.encode_special_tokens = not parse_special
    try:
        ids: list[int] = INNER.encode(text).ids
        return ids
    finally:
        INNER.encode_special_tokens = previous


def test_it_applies_to_the_default_tokenizer() -> None:
    assert ENCODER is not None


ascii_text = st.lists(
    st.one_of(
        st.text(alphabet=string.printable + "\x00\x01\x0b\x1c\x1f\x7f", max_size=12),
        st.sampled_from([*SPECIALS, "'s", "'ll", "'D", " 2024", "  \n\n ", "\t", "x" * 40]),
    ),
    max_size=8,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=ascii_text, parse_special=st.booleans())
def test_ascii_text_encodes_exactly_as_the_tokenizer(text: str, parse_special: bool) -> None:
    assert ENCODER is not None
    assert ENCODER.encode(text, parse_special=parse_special) == reference(
        text, parse_special=parse_special
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
        "price: 1234.50 dollars, 2 items",
        "trailing spaces   \n  ",
        "it's we'll they'RE",
        "<|im_start|><|im_start|>",
    ],
)
def test_examples(text: str) -> None:
    assert ENCODER is not None
    for parse_special in (True, False):
        assert ENCODER.encode(text, parse_special=parse_special) == reference(
            text, parse_special=parse_special
        )


def test_non_ascii_text_is_left_to_the_tokenizer() -> None:
    assert ENCODER is not None
    assert ENCODER.encode("café", parse_special=True) is None


def test_other_tokenizers_are_declined() -> None:
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    assert AsciiEncoder.for_tokenizer(word_level) is None
    with_prefix = tokenizers.Tokenizer(tokenizers.models.BPE())
    with_prefix.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert AsciiEncoder.for_tokenizer(with_prefix) is None
