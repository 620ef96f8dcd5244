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
* :meth:`Tokenizer.decode_stream` gives an :class:`~operators.text.detokenizer.IncrementalDecoder`
  that turns generated ids into text one id at a time (the hot path: one call per generated
  token) without ever emitting half of a multi-byte character; :mod:`operators.text.detokenizer`
  holds the decoders (a dictionary lookup per token for byte-level tokenizers such as ours).
"""

from operators.text.detokenizer import IncrementalDecoder

from .config import CONFIG_FILE, TOKENIZER_FILE, TokenizerMetadata
from .location import SMOLLM2_GGUF_FILENAME, find_smollm2_gguf
from .tokenizer import Tokenizer

__all__ = (
    "CONFIG_FILE",
    "IncrementalDecoder",
    "SMOLLM2_GGUF_FILENAME",
    "TOKENIZER_FILE",
    "Tokenizer",
    "TokenizerMetadata",
    "find_smollm2_gguf",
)
