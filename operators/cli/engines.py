"""The engines ``serve`` and ``worker`` run, built from an :class:`EngineConfig`.

Echo and mocker engines are cheap and built per worker; the llama engine loads a model, so
it is loaded once, in a thread (loading blocks), and its statistics feed the server's
metrics.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.edges.http.metrics import BatchingCounts, ServerMetrics
from operators.engines import EchoEngine
from operators.engines._prefix_cache import DEFAULT_CACHE_BLOCKS
from operators.engines.mocker import MockerEngine
from operators.text.tokenizer import Tokenizer
from pipeline import WorkerSet

if TYPE_CHECKING:
    from .config import EngineConfig

__all__ = ("load_llama", "load_tokenizer", "make_engine", "watch_llama", "worker_set")

_Workers = WorkerSet[PreprocessedRequest, EngineOutput]


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The tokenizer at ``path`` (tokenizer.json, its directory, or a .gguf file); None:
    the shipped SmolLM2 one."""
    if path is None:
        return Tokenizer.default()
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_file(path)


def make_engine(
    config: EngineConfig, tokenizer: Tokenizer, role: str, worker_id: str, *, kv: bool = False
) -> Any:
    """An echo or mocker engine as ``config`` says, for one worker in ``role``.

    ``kv``: a KV router will listen to the mocker's cache, which is then on unless
    ``--mocker-cache-blocks`` says otherwise (without a listener the cache would only
    change the timing users know).
    """
    if config.engine == "echo":
        return EchoEngine.from_tokenizer(
            tokenizer,
            delay_ms=config.echo_delay_ms,
            cycle=config.echo_cycle,
            fail_after_tokens=config.fail_after_tokens,
        )
    secret = config.transfer_secret
    cache_blocks = config.mocker_cache_blocks
    if cache_blocks is None:
        cache_blocks = DEFAULT_CACHE_BLOCKS if kv else 0
    return MockerEngine.from_tokenizer(
        tokenizer,
        role=role,
        worker_id=worker_id,
        prefill_ms_per_token=config.mocker_prefill_ms_per_token,
        decode_ms_per_step=config.mocker_decode_ms_per_step,
        max_batch=config.mocker_max_batch,
        tokens=config.mocker_tokens,
        seed=config.mocker_seed,
        fail_after_tokens=config.fail_after_tokens,
        transfer_secret=None if secret is None else secret.encode(),
        block_size=config.kv_block_size,
        cache_blocks=cache_blocks,
    )


def worker_set(
    config: EngineConfig, tokenizer: Tokenizer, role: str, count: int, *, kv: bool = False
) -> _Workers | None:
    """``count`` in-process workers in ``role`` (None for none), named ``ROLE-i``; ``kv``:
    behind a KV router (see :func:`make_engine`)."""
    if count == 0:
        return None
    return WorkerSet(
        role,
        {
            f"{role}-{i}": make_engine(config, tokenizer, role, f"{role}-{i}", kv=kv)
            for i in range(count)
        },
    )


async def load_llama(config: EngineConfig) -> Any:
    """The llama.cpp engine ``config`` describes, loaded in a thread (loading blocks)."""
    from operators.engines.llama import LlamaEngine, NgramSpeculation

    speculative = (
        NgramSpeculation(ngram_size=config.ngram_size, num_draft_tokens=config.draft_tokens)
        if config.speculative == "ngram"
        else None
    )
    return await anyio.to_thread.run_sync(
        functools.partial(
            LlamaEngine,
            config.model,
            n_ctx=config.n_ctx,
            n_threads=config.threads,
            parallel=config.parallel,
            step_tokens=config.step_tokens,
            speculative=speculative,
            block_size=config.kv_block_size,
        )
    )


def watch_llama(metrics: ServerMetrics, engine: Any) -> None:
    """Export the llama engine's batching and speculation statistics in ``metrics``."""

    def batching() -> BatchingCounts:
        stats = engine.statistics()
        return BatchingCounts(
            running=stats.running_sequences,
            waiting=stats.waiting_sequences,
            batch_sizes=stats.batch_sizes,
            prefill_tokens=stats.prefill_tokens,
            cached_prompt_tokens=stats.cached_prompt_tokens,
            decode_tokens=stats.decode_tokens,
        )

    def speculation() -> tuple[int, int]:
        stats = engine.statistics()
        return stats.speculative_proposed, stats.speculative_accepted

    metrics.watch_speculation(speculation)
    metrics.watch_batching(batching)
