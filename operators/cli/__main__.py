"""``python -m operators.cli``: the same as the ``llm-pipeline`` command."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
