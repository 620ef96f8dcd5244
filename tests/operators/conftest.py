"""The tests below ``tests/operators`` share its helpers (``byte_tokenizer``, ``shout``,
``server_process``, ``client_view``, ``output_scripts``): put
that directory on the import path, as pytest does for the test modules that live in it, so
the tests that mirror the package's folders (``text/``, ``routing/``, ``edges/openai/``...)
import them the same way."""

from __future__ import annotations

import sys
from pathlib import Path

_HELPERS = str(Path(__file__).resolve().parent)
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
