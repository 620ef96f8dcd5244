"""The parser tests share ``tests/operators``' helpers (``byte_tokenizer``): put that
directory on the import path, as pytest does for the test modules that live in it."""

from __future__ import annotations

import sys
from pathlib import Path

_HELPERS = str(Path(__file__).resolve().parent.parent)
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
