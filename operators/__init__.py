"""The LLM layer of llm-pipeline, built only on ``pipeline``'s public API.

- :mod:`operators.llm` — hot-path types (PreprocessedRequest, EngineOutput, BackendOutput).
- :mod:`operators.tokenizer` — Tokenizer (the shipped SmolLM2 one by default).
- :mod:`operators.stop_jail` — StopJail, the sans-IO stop-string matcher.
- :mod:`operators.backend`, :mod:`operators.migration` — the token Backend and Migration;
  :mod:`operators.resumption` — the contract between them (Migration upstream).
- :mod:`operators.openai` — the OpenAI protocol, preprocessor and HTTP server.
- :mod:`operators.engines` — built-in engines (echo, mocker, llama.cpp).
- :mod:`operators.serving` — ``build_app`` and ``serve``: a graph as an OpenAI server
  (also ``operators.build_app``/``operators.serve``, imported on first use: the HTTP stack
  is not loaded by ``import operators``).
- :mod:`operators.testing` — ``openai_client``: the official client, in-process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backend import Backend as Backend
from .llm import BackendOutput as BackendOutput
from .llm import EngineOutput as EngineOutput
from .llm import OutputOptions as OutputOptions
from .llm import PreprocessedRequest as PreprocessedRequest
from .llm import SamplingOptions as SamplingOptions
from .llm import StopConditions as StopConditions
from .migration import Migration as Migration
from .stop_jail import StopJail as StopJail
from .tokenizer import Tokenizer as Tokenizer

if TYPE_CHECKING:
    from .graph import default_graph as default_graph
    from .serving import build_app as build_app
    from .serving import serve as serve

__all__ = (
    "Backend",
    "BackendOutput",
    "EngineOutput",
    "Migration",
    "OutputOptions",
    "PreprocessedRequest",
    "SamplingOptions",
    "StopConditions",
    "StopJail",
    "Tokenizer",
    "build_app",
    "default_graph",
    "serve",
)

_LAZY = {"build_app": "serving", "serve": "serving", "default_graph": "graph"}


def __getattr__(name: str) -> Any:
    """``build_app``, ``serve`` and ``default_graph``, imported when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'operators' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
