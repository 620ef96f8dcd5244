"""Engines that end a graph: they turn a PreprocessedRequest into EngineOutputs.

- :class:`EchoEngine` — streams the prompt's token ids back (the CLI default; tests and
  load tests).
- :class:`operators.engines.mocker.MockerEngine` — simulated prefill/decode timing with
  continuous batching, in every worker role (aggregated, prefill, decode, encode).
- :class:`operators.engines.llama.LlamaEngine` — a real model (SmolLM2 by default) through
  llama-cpp-python, with prompt-lookup speculation (:mod:`operators.engines.ngram`). Not
  re-exported here, so that importing this package never loads llama.cpp or numpy.

A user's own engine plugs in the same way: any object with
``generate(ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]``, or a function that
yields token ids wrapped by :func:`token_engine` (:mod:`operators.engines.token_engine`),
which keeps the rest of the engine contract for it.
"""

from __future__ import annotations

from .echo import DEFAULT_CYCLE_TOKENS as DEFAULT_CYCLE_TOKENS
from .echo import EchoEngine as EchoEngine
from .echo import echo_logprob as echo_logprob
from .token_engine import TokenEngine as TokenEngine
from .token_engine import TokenFunction as TokenFunction
from .token_engine import token_engine as token_engine

__all__ = (
    "DEFAULT_CYCLE_TOKENS",
    "EchoEngine",
    "TokenEngine",
    "TokenFunction",
    "echo_logprob",
    "token_engine",
)
