"""GGUF -> ``tokenizers``: rebuild the tokenizer a GGUF file embeds, as llama.cpp reads it.

Apart from :class:`~operators.text.tokenizer.Tokenizer` because it runs once, offline
(``scripts/convert_gguf_tokenizer.py``), and needs the optional ``gguf`` package; serving
only loads the converted files. The tables below mirror llama.cpp, so that our ids and our
end-of-generation set are the engine's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Final

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from .config import TokenizerMetadata

__all__ = ("convert_gguf",)

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
# Only "smollm" is verified against llama.cpp ids (tests/operators/text/data/tokenizer_golden.json).
_DIGITS_THEN_GPT2_PRE: Final = frozenset({"smollm", "starcoder"})
_GPT2_PRE: Final = frozenset({"gpt-2"})


def convert_gguf(path: str | Path) -> tuple[tokenizers.Tokenizer, TokenizerMetadata]:
    """The tokenizer and metadata embedded in the GGUF at ``path``
    (:meth:`~operators.text.tokenizer.Tokenizer.from_gguf` says what is reproduced)."""
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
    return inner, metadata


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
            stacklevel=4,  # the caller of Tokenizer.from_gguf
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
