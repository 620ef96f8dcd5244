"""Long texts encoded piece by piece: the same ids as one call, and a cancellable encode."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.text.ascii_encoder import decisive_config
from operators.text.long_text import PIECE_CHARS, pieces, splits_safely
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()
#: the shipped tokenizer treating control-token texts as plain text
PLAIN = tokenizers.Tokenizer.from_str(TOKENIZER.inner.to_str())
PLAIN.encode_special_tokens = True
# Words that exercise the splits around a cut: letters, digits, punctuation, contractions,
# runs of white space, non-ASCII letters, control-token texts.
WORDS = ["a", "word", "Word", "12", "7", "x1", "it's", "don't", ",", "!?", "  ", "\n", "\t",
         " ", "naïve", "東京", "данные", "☃", "<|im_start|>", "<|im_end|>", "<file_sep>",
         "'s", "\u00a0", "e\u0301"]  # fmt: skip


def _text(words: list[str], separators: list[str]) -> str:
    return "".join(word + separators[i % len(separators)] for i, word in enumerate(words))


@given(
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=200),
    separators=st.lists(st.sampled_from([" ", "", "  ", "\n"]), min_size=1, max_size=5),
    size=st.integers(1, 64),
)
def test_pieces_concatenate_to_the_text_and_cut_only_before_a_space(
    words: list[str], separators: list[str], size: int
) -> None:
    text = _text(words, separators)
    parts = list(pieces(text, size))
    assert "".join(parts) == text
    for before, after in itertools.pairwise(parts):
        assert len(before) >= size
        assert before[-1].isascii()
        assert before[-1].isalnum()
        assert after[0] == " "
        assert after[1].isascii()
        assert after[1].isalpha()


@settings(max_examples=40, deadline=None)
@given(
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=300),
    separators=st.lists(st.sampled_from([" ", "", "  ", "\n"]), min_size=1, max_size=5),
    parse_special=st.booleans(),
)
def test_a_long_text_gets_the_ids_of_one_call(
    words: list[str], separators: list[str], parse_special: bool
) -> None:
    unit = _text(words, separators)
    text = (unit + " ") * (PIECE_CHARS // len(unit) + 2)  # longer than one piece
    assert len(text) > PIECE_CHARS
    whole = TOKENIZER.inner.encode(text, add_special_tokens=False)
    got = TOKENIZER.encode(text, parse_special=parse_special)
    if parse_special:
        assert got == whole.ids
    else:
        assert got == PLAIN.encode(text, add_special_tokens=False).ids


def test_the_shipped_tokenizer_is_cut_and_ids_share_int_objects() -> None:
    text = "many words here " * (PIECE_CHARS // 4)
    ids = TOKENIZER.encode(text)
    assert ids == TOKENIZER.inner.encode(text, add_special_tokens=False).ids
    assert len({id(i) for i in ids}) == len(set(ids))  # one object per distinct id


def _config(**changes: Any) -> dict[str, Any]:
    config = decisive_config(TOKENIZER.inner)
    config.update(changes)
    return config


def test_which_tokenizers_may_be_cut() -> None:
    assert splits_safely(_config())
    assert not splits_safely(_config(normalizer={"type": "NFKC"}))
    assert not splits_safely(_config(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True}))
    assert not splits_safely(_config(pre_tokenizer={"type": "Metaspace"}))
    assert not splits_safely(_config(model={"type": "WordPiece"}))
    spaced = {"content": "<fim prefix>", "lstrip": False, "rstrip": False, "single_word": False}
    assert not splits_safely(_config(added_tokens=[spaced]))
    stripping = {"content": "<x>", "lstrip": False, "rstrip": True, "single_word": False}
    assert not splits_safely(_config(added_tokens=[stripping]))


async def test_a_cancelled_encode_in_a_worker_thread_stops_between_pieces() -> None:
    text = "many words here " * (PIECE_CHARS * 4)  # 64 pieces
    entered = threading.Event()
    go = threading.Event()
    finished = threading.Event()

    def encode() -> list[int]:
        entered.set()
        go.wait()
        ids = TOKENIZER.encode(text)
        finished.set()
        return ids

    with anyio.fail_after(30):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, encode)
                await anyio.to_thread.run_sync(entered.wait)
                scope.cancel()
                go.set()
        assert scope.cancelled_caught
        assert not finished.is_set()


def test_encode_outside_a_worker_thread_ignores_cancellation_points() -> None:
    text = "many words here " * PIECE_CHARS
    assert TOKENIZER.encode(text) == TOKENIZER.inner.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_add_special_tokens_on_long_text_matches_one_call(add_special_tokens: bool) -> None:
    text = "x y " * PIECE_CHARS
    expected = TOKENIZER.inner.encode(text, add_special_tokens=add_special_tokens).ids
    assert TOKENIZER.encode(text, add_special_tokens=add_special_tokens) == expected
