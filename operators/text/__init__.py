"""Text machinery: between the text users send and read and the token ids engines see.

:mod:`.tokenizer` (text <-> ids, exactly the engine's), :mod:`.detokenizer` (ids -> text one
token at a time, never half a character), :mod:`.stop_jail` (holds back text that may still
become a stop string), :mod:`.ascii_encoder` (byte-level encoding without the Rust
tokenizer) and :mod:`.long_text` (cutting long prompts safely). None of it knows an API edge,
an engine or the CLI.
"""

from __future__ import annotations

__all__ = ()
