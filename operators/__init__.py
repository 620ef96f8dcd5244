"""The LLM layer of llm-pipeline, built only on ``pipeline``'s public API.

- :mod:`operators.llm` — hot-path types (PreprocessedRequest, EngineOutput, BackendOutput).
- :mod:`operators.tokenizer` — Tokenizer (the shipped SmolLM2 one by default).
- :mod:`operators.stop_jail` — StopJail, the sans-IO stop-string matcher.
- :mod:`operators.backend`, :mod:`operators.migration` — the token Backend and Migration;
  :mod:`operators.resumption` — the contract between them (Migration upstream).
- :mod:`operators.openai` — the OpenAI protocol, preprocessor and HTTP server.
- :mod:`operators.engines` — built-in engines (echo, mocker, llama.cpp).
- :mod:`operators.serving` — ``build_app`` and ``serve``: a graph as an OpenAI server.
- :mod:`operators.testing` — ``openai_client``: the official client, in-process.
"""

from __future__ import annotations

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
)
