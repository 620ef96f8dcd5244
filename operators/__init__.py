"""The LLM layer of llm-pipeline, built only on ``pipeline``'s public API.

The folders say what is what:

- :mod:`operators.edges` — the API edges, side by side: :mod:`operators.edges.openai` (the
  OpenAI protocol, preprocessor and HTTP server). An edge parses its API's requests into what
  the graph takes and renders the graph's typed events in its own wire format.
- :mod:`operators.text` — text machinery: ``Tokenizer`` (:mod:`operators.text.tokenizer`, the
  shipped SmolLM2 one by default), the incremental detokenizer, ``StopJail`` (the sans-IO
  stop-string matcher), the ASCII fast encoder and long-prompt pieces.
- :mod:`operators.routing` — KV block hashes, the encoder and prefill (disaggregation) routers.
- :mod:`operators.contracts` — what the rest agrees on: :mod:`operators.contracts.llm`
  (PreprocessedRequest, EngineOutput, BackendOutput), resumption (Migration <-> Backend),
  rewriting, the constraint guard, the NATS transport types.
- The graph's own operators and the entry points stay here: :mod:`operators.backend` (the
  token Backend), :mod:`operators.migration`, :mod:`operators.parsers`,
  :mod:`operators.engines` (echo, mocker, llama.cpp), :mod:`operators.graph`
  (``default_graph``), :mod:`operators.serving` (``build_app`` and ``serve``: a graph as an
  OpenAI server; also ``operators.build_app``/``operators.serve``, imported on first use: the
  HTTP stack is not loaded by ``import operators``), :mod:`operators.testing`
  (``openai_client``: the official client, in-process) and :mod:`operators.cli`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backend import Backend as Backend
from .contracts.llm import BackendOutput as BackendOutput
from .contracts.llm import EngineOutput as EngineOutput
from .contracts.llm import OutputOptions as OutputOptions
from .contracts.llm import PreprocessedRequest as PreprocessedRequest
from .contracts.llm import SamplingOptions as SamplingOptions
from .contracts.llm import StopConditions as StopConditions
from .migration import Migration as Migration
from .text.stop_jail import StopJail as StopJail
from .text.tokenizer import Tokenizer as Tokenizer

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
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'operators' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
