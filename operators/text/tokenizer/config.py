"""A tokenizer's configuration on disk: the file names and :class:`TokenizerMetadata`.

Apart from the encoding code because it is the one format we share with other tools: our
``tokenizer_config.json`` is a superset of Hugging Face's, read and written here only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import tokenizers

__all__ = ("CONFIG_FILE", "TOKENIZER_FILE", "TokenizerMetadata")

TOKENIZER_FILE: Final = "tokenizer.json"
CONFIG_FILE: Final = "tokenizer_config.json"


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
