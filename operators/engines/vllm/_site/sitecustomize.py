"""Run first in every process vLLM spawns once torchvision was found unable to load: this
folder is put on their ``PYTHONPATH`` by :mod:`operators.engines.vllm._torchvision`, which
says why. Spawned processes import vLLM (and so transformers) before any module of ours,
so the hiding cannot wait for one: Python imports ``sitecustomize`` at start-up. The
``sitecustomize`` this one shadows, if there is one, runs after it.
"""

import importlib.machinery
import importlib.util
import os
import sys

__all__ = ()

if os.environ.get("LLM_PIPELINE_HIDE_TORCHVISION") == "1":
    sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SHADOWED = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [path for path in sys.path if os.path.abspath(path or ".") != _HERE]
)
if _SHADOWED is not None and _SHADOWED.loader is not None:
    _SHADOWED.loader.exec_module(importlib.util.module_from_spec(_SHADOWED))
