"""The :class:`Tokenizer`: text <-> token ids, as the engine (llama.cpp) sees them.

Encoding (with its ASCII fast path and long texts in pieces) and the choice of incremental
decoder live here; the package docstring (:mod:`operators.text.tokenizer`) says why the graph
tokenizes at all.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import anyio.from_thread
import tokenizers

from operators.text.ascii_encoder import AsciiEncoder, decisive_config
from operators.text.detokenizer import (
    ByteLevelDecoder,
    ByteLevelVocabulary,
    IncrementalDecoder,
    StreamDecoder,
    has_byte_level_decoder,
)
from operators.text.long_text import PIECE_CHARS, pieces, splits_safely

from .config import CONFIG_FILE, TOKENIZER_FILE, TokenizerMetadata
from .conversion import convert_gguf

__all__ = ("Tokenizer",)

_UNSET: Final = object()  # a lazily built attribute not built yet


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids and chat template of its model."""

    __slots__ = (
        "_ascii",
        "_byte_level",
        "_inner",
        "_inners",
        "_long",
        "_max_token_chars",
        "_metadata",
        "_shared_ids",
        "_special_token_ids",
    )

    def __init__(
        self, inner: tokenizers.Tokenizer, metadata: TokenizerMetadata | None = None
    ) -> None:
        self._inner = inner
        # Per encode_special_tokens value: ``inner`` serves its own, a copy made on first use
        # the other one. (Flipping the flag around a call would race with a worker thread.)
        self._inners: dict[bool, tokenizers.Tokenizer] = {inner.encode_special_tokens: inner}
        self._ascii: AsciiEncoder | object | None = _UNSET
        # whether long texts are encoded piece by piece, per add_special_tokens value
        self._long: tuple[bool, bool] | None = None
        self._shared_ids: list[int] = []  # one int object per id, for long texts' ids
        self._max_token_chars = 0
        self._metadata = metadata if metadata is not None else TokenizerMetadata()
        self._special_token_ids = frozenset(
            token_id
            for token_id, token in inner.get_added_tokens_decoder().items()
            if token.special
        )
        # Per skip_special_tokens value (index False/True), filled lazily by the decoders; None
        # when the decoder is not plain ByteLevel (then DecodeStream does the work).
        self._byte_level: tuple[ByteLevelVocabulary, ByteLevelVocabulary] | None = (
            (
                ByteLevelVocabulary(inner, skip_special_tokens=False),
                ByteLevelVocabulary(inner, skip_special_tokens=True),
            )
            if has_byte_level_decoder(inner)
            else None
        )

    # ----------------------------------------------------------------------------- loading

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (a file, or a directory holding it and optionally
        ``tokenizer_config.json`` with the special ids and chat template)."""
        path = Path(path)
        directory = path if path.is_dir() else path.parent
        file = path / TOKENIZER_FILE if path.is_dir() else path
        inner = tokenizers.Tokenizer.from_file(str(file))
        config_path = directory / CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        return cls(inner, TokenizerMetadata.from_config(config, inner))

    @classmethod
    def default(cls) -> Tokenizer:
        """The shipped SmolLM2-135M-Instruct tokenizer (loaded once, then cached)."""
        return _load_default()

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuild the tokenizer embedded in a GGUF file (byte-level BPE models only).

        Reproduces llama.cpp's tokenization for ``tokenizer.ggml.pre`` in "smollm" (verified id
        for id), "starcoder" and "gpt-2". Other pre-tokenizer types fall back to the plain GPT-2
        split with a warning: ids may then differ from llama.cpp's (e.g. llama3/qwen2 split
        digit runs in groups of three and use a different regex). Takes seconds (it reads the
        whole file): convert once and ship ``tokenizer.json`` instead.
        """
        return cls(*convert_gguf(path))

    def save(self, directory: str | Path, *, extra_config: Mapping[str, Any] | None = None) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``.

        ``extra_config``: more keys for ``tokenizer_config.json`` (e.g. provenance); ignored
        when loading.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TOKENIZER_FILE).write_text(self._inner.to_str(pretty=False), encoding="utf-8")
        config = self._metadata.to_config(self._inner) | dict(extra_config or {})
        (directory / CONFIG_FILE).write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    # ------------------------------------------------------------------------- properties

    @property
    def inner(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._inner

    @property
    def metadata(self) -> TokenizerMetadata:
        return self._metadata

    @property
    def name(self) -> str | None:
        return self._metadata.name

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: llama.cpp's end-of-generation set, eos_token_id included.

        For SmolLM2: 2 ``<|im_end|>``, 0 ``<|endoftext|>`` and 4 ``<reponame>`` (llama.cpp
        treats FIM repo tokens as end of generation).
        """
        return self._metadata.eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        """The model's declared EOS id (SmolLM2: 2 ``<|im_end|>``)."""
        return self._metadata.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._metadata.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._metadata.pad_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special (control) tokens: skipped by ``skip_special_tokens=True``."""
        return self._special_token_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template shipped with the model, if any."""
        return self._metadata.chat_template

    @property
    def vocab_size(self) -> int:
        return self._inner.get_vocab_size(with_added_tokens=True)

    # ----------------------------------------------------------------------- conversions

    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``.

        ``parse_special=False`` encodes control-token texts such as ``<|im_start|>`` as plain
        text (llama.cpp ``special=False``): use it for user-supplied text. Rendered chat
        templates need the default ``True``. ``add_special_tokens`` adds BOS/EOS only if the
        model asks for them (SmolLM2 does not).

        A text longer than :data:`~operators.text.long_text.PIECE_CHARS` is encoded in pieces
        (:mod:`operators.text.long_text`: the same ids, a few ms per piece): from a worker thread
        (``anyio.to_thread``) that keeps the event loop responsive, and a cancelled caller
        stops between pieces. Safe to call from several threads at once.
        """
        if isinstance(text, str) and len(text) > PIECE_CHARS and self._cuts(add_special_tokens):
            table = self._shared_ids
            ids: list[int] = []
            for piece in pieces(text):
                ids.extend(
                    map(table.__getitem__, self._encode(piece, add_special_tokens, parse_special))
                )
                _cancel_point()
            return ids
        return self._encode(text, add_special_tokens, parse_special)

    def _encode(self, text: str, add_special_tokens: bool, parse_special: bool) -> list[int]:
        fast = self._ascii_encoder()
        if fast is not None:
            ids = fast.encode(
                text, parse_special=parse_special, add_special_tokens=add_special_tokens
            )
            if ids is not None:
                return ids
        treat_as_text = not parse_special
        inner = self._inners.get(treat_as_text)
        if inner is None:
            inner = tokenizers.Tokenizer.from_str(self._inner.to_str())
            inner.encode_special_tokens = treat_as_text
            self._inners[treat_as_text] = inner
        return inner.encode(text, add_special_tokens=add_special_tokens).ids

    def _cuts(self, add_special_tokens: bool) -> bool:
        """Whether long texts may be encoded in pieces (decided, and checked, on first use).

        Not when ``add_special_tokens`` adds ids: BOS/EOS would be added to every piece.
        """
        if self._long is None:
            inner = self._inner
            safe = splits_safely(decisive_config(inner))
            if safe:  # a check of the rule on this tokenizer: cuts every 16 characters
                probe = "Cut 12 here, ok. Ça va? x1 y " * 8
                whole = inner.encode(probe, add_special_tokens=False).ids
                cut = [
                    i
                    for p in pieces(probe, 16)
                    for i in inner.encode(p, add_special_tokens=False).ids
                ]
                safe = whole == cut
            plain = inner.encode("Hi 12", add_special_tokens=False).ids
            adds = inner.encode("Hi 12", add_special_tokens=True).ids != plain
            added = inner.get_added_tokens_decoder()
            size = max(inner.get_vocab_size(with_added_tokens=True), max(added, default=0) + 1)
            self._shared_ids = list(range(size))
            self._long = (safe, safe and not adds)
        return self._long[add_special_tokens]

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a text of N characters has at least
        ``ceil(N / max_token_chars)`` tokens, so a request can be refused without encoding it.
        """
        if not self._max_token_chars:
            vocab = self._inner.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(map(len, vocab), default=1)
        return self._max_token_chars

    def _ascii_encoder(self) -> AsciiEncoder | None:
        """The ASCII fast path for this tokenizer (built on first use), if it applies."""
        if self._ascii is _UNSET:
            self._ascii = AsciiEncoder.for_tokenizer(self._inner)
        return self._ascii  # type: ignore[return-value]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form a whole character become U+FFFD."""
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, *, skip_special_tokens: bool, prompt_ids: Sequence[int] = ()
    ) -> IncrementalDecoder:
        """A fresh :class:`IncrementalDecoder` for one generation.

        ``prompt_ids``: the prompt the generated ids continue; its last few ids give the
        decoder context (only the generated text is returned). A byte-level tokenizer gets the
        fast :class:`~operators.text.detokenizer.ByteLevelDecoder` (which needs no context), any
        other one a ``DecodeStream``-backed :class:`~operators.text.detokenizer.StreamDecoder`; both
        return the same results.
        """
        byte_level = self._byte_level
        if byte_level is not None:
            return ByteLevelDecoder(byte_level[skip_special_tokens])
        return StreamDecoder(
            self._inner, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids
        )

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (byte-level form, e.g. ``"Ġhello"``)."""
        return self._inner.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._inner.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------- helpers


def _cancel_point() -> None:
    """Raise the host task's cancellation in an anyio worker thread whose task was cancelled;
    nothing anywhere else."""
    try:
        anyio.from_thread.check_cancelled()
    except RuntimeError:  # not in an anyio worker thread
        pass


@functools.cache
def _load_default() -> Tokenizer:
    data = importlib.resources.files("operators") / "data" / "smollm2"
    inner = tokenizers.Tokenizer.from_str((data / TOKENIZER_FILE).read_text("utf-8"))
    config = json.loads((data / CONFIG_FILE).read_text("utf-8"))
    return Tokenizer(inner, TokenizerMetadata.from_config(config, inner))
