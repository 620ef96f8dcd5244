"""The engines ``serve`` and ``worker`` run, built from an :class:`EngineConfig`.

Echo and mocker engines are cheap and built per worker; the llama engine loads a model, so
it is loaded once, in a thread (loading blocks), and its statistics feed the server's
metrics. The remote engine connects to its upstream servers (:func:`open_remote`), whose
``llm_pipeline_upstream_*`` series are registered like the vLLM engine's
(:func:`watch_upstreams`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.engines import EchoEngine
from operators.engines._prefix_cache import DEFAULT_CACHE_BLOCKS
from operators.engines.mocker import MockerEngine
from operators.telemetry import engine_metrics
from operators.telemetry.engine_metrics import BatchingCounts, EngineLoad, KvCounts
from operators.text.tokenizer import Tokenizer
from pipeline import WorkerSet

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from operators.engines.llama import LlamaOptions
    from operators.engines.remote import UpstreamFleet

    from .config import EngineConfig

__all__ = (
    "Supervise",
    "llama_engine_options",
    "load_engine",
    "load_llama",
    "load_llama_workers",
    "load_tokenizer",
    "load_vllm",
    "make_engine",
    "open_remote",
    "watch_engine",
    "watch_engines",
    "watch_llama",
    "watch_upstreams",
    "watch_vllm",
    "worker_set",
)

_Workers = WorkerSet[PreprocessedRequest, EngineOutput]

Supervise = Callable[[Any, str, Callable[[], Awaitable[Any]]], Any]
"""``supervise(engine, name, factory)``: ``engine`` under watch, rebuilt by ``factory``."""


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
            tokens_per_turn=config.echo_tokens_per_turn,
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
        decode_ms_per_sequence=config.mocker_decode_ms_per_sequence,
        max_batch=config.mocker_max_batch,
        tokens=config.mocker_tokens,
        seed=config.mocker_seed,
        fail_after_tokens=config.fail_after_tokens,
        freeze_after_tokens=config.freeze_after_tokens,
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


def llama_engine_options(
    config: EngineConfig,
    role: Any = "aggregated",
    worker_id: str = "llama",
    *,
    disk_cache: Path | None = None,
) -> LlamaOptions:
    """The options of the llama engine ``config`` describes, in ``role`` as ``worker_id``:
    ``config.llama`` (the llama flags') with the options other engines share (block size,
    transfer secret, adapters); its disk tier in ``disk_cache`` (None: ``--kv-disk-cache``).
    """
    secret = config.transfer_secret
    return dataclasses.replace(
        config.llama,
        block_size=config.kv_block_size,
        role=role,
        worker_id=worker_id,
        transfer_secret=None if secret is None else secret.encode(),
        kv_disk_cache=config.llama.kv_disk_cache if disk_cache is None else disk_cache,
        loras={name: str(path) for name, path in config.lora},
    )


async def load_llama(
    config: EngineConfig,
    role: Any = "aggregated",
    worker_id: str = "llama",
    *,
    disk_cache: Path | None = None,
) -> Any:
    """The llama.cpp engine ``config`` describes (:func:`llama_engine_options`), loaded in
    a thread (loading blocks)."""
    from operators.engines.llama import LlamaEngine

    options = llama_engine_options(config, role, worker_id, disk_cache=disk_cache)
    return await anyio.to_thread.run_sync(
        functools.partial(LlamaEngine, config.model, options=options)
    )


async def load_llama_workers(
    config: EngineConfig,
    role: str,
    count: int,
    *,
    shared: bool = False,
    supervise: Supervise | None = None,
) -> _Workers | None:
    """``count`` llama engines in ``role`` (None for none), named ``ROLE-i``; engines
    loaded before a failure are closed. ``shared``: other engines of this process use
    ``--kv-disk-cache`` too, so each gets a folder of its own in it (a disk tier is one
    process's, and so one engine's). ``supervise(engine, name, factory)`` puts each under
    watch (``factory`` loads it again, as it was loaded)."""
    if count == 0:
        return None
    engines: dict[str, Any] = {}
    try:
        for i in range(count):
            name = f"{role}-{i}"
            disk = config.llama.kv_disk_cache
            folder = None if disk is None or not (shared or count > 1) else Path(disk) / name
            factory = functools.partial(load_llama, config, role, name, disk_cache=folder)
            engines[name] = await factory()
            if supervise is not None:
                engines[name] = supervise(engines[name], name, factory)
    except BaseException:
        for engine in engines.values():
            engine.close()
        raise
    return WorkerSet(role, engines)


async def load_vllm(config: EngineConfig, *, log_level: str = "warning") -> Any:
    """The vLLM engine ``config`` describes, started in a thread (it spawns vLLM's
    processes and loads the model: seconds to a minute). Cancelled meanwhile (a signal),
    the engine is stopped as soon as it is up: its processes must not outlive the call."""
    from operators.engines.vllm import VllmEngine

    started: list[VllmEngine] = []

    def start() -> VllmEngine:
        started.append(
            VllmEngine(
                config.model,
                dtype=config.dtype,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                gpu_memory_utilization=config.gpu_memory_utilization,
                tensor_parallel_size=config.tensor_parallel_size,
                vllm_block_size=config.block_size,
                block_size=config.kv_block_size,
                fail_after_tokens=config.fail_after_tokens,
                log_level=log_level,
                loras=dict(config.lora),
            )
        )
        return started[0]

    try:
        return await anyio.to_thread.run_sync(start)
    except BaseException:
        if started:
            await started[0].aclose()
        raise


async def load_engine(
    config: EngineConfig,
    *,
    log_level: str = "warning",
    role: Any = "aggregated",
    worker_id: str = "llama",
) -> Any:
    """The model engine (llama or vllm) ``config`` asks for (a llama engine in ``role``,
    as ``worker_id``)."""
    if config.engine == "vllm":
        return await load_vllm(config, log_level=log_level)
    return await load_llama(config, role, worker_id)


@asynccontextmanager
async def open_remote(
    config: EngineConfig, tokenizer: Tokenizer | None, role: str = "aggregated"
) -> AsyncIterator[UpstreamFleet]:
    """The upstream servers ``--upstream`` names, connected and watched while the context
    is open (:func:`operators.engines.remote.open_upstreams`).

    Raises:
        ConnectionError: none answered; ValueError: one is neither vLLM nor llama-server;
        ImportError: ``kv=`` without pyzmq and msgspec.
    """
    from operators.engines.remote import open_upstreams, parse_upstream

    upstreams = [parse_upstream(text, config.upstream_kind) for text in config.upstream]
    async with open_upstreams(
        upstreams,
        tokenizer=tokenizer,
        block_size=config.kv_block_size,
        poll_interval=config.upstream_poll_ms / 1000,
        stall_timeout=config.upstream_timeout,
        role=role,
    ) as fleet:
        yield fleet


def watch_upstreams(registry: CollectorRegistry, fleets: Sequence[UpstreamFleet]) -> None:
    """Export the upstreams' ``llm_pipeline_upstream_*`` series in ``registry``, every
    model's in one collector (read at each scrape: upstreams that join later are
    included)."""
    from operators.engines.remote import UpstreamCollector

    registry.register(
        UpstreamCollector(lambda: [engine for fleet in fleets for engine in fleet.engines])
    )


def watch_engines(
    registry: CollectorRegistry, engines: Sequence[Any], *, prefill: Sequence[Any] = ()
) -> None:
    """Export in ``registry`` the statistics of every model engine a server loaded (one per
    model of ``--models``, or in-process workers; ``prefill``: llama prefill workers): the
    ``llm_pipeline_llama_*`` and ``llm_pipeline_vllm_*`` series sum over the engines of
    their kind."""
    llama = [engine for engine in engines if hasattr(engine, "recent_steps")]
    vllm = [engine for engine in engines if not hasattr(engine, "recent_steps")]
    if llama or prefill:
        watch_llama(registry, *llama, prefill=prefill)
    if len(vllm) == 1:
        watch_vllm(registry, vllm[0])
    elif vllm:
        watch_vllm(registry, _Summed(vllm))


class _Summed:
    """Several engines' ``statistics()`` as one: counts added (sequences by place), ratios
    averaged."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self._engines = engines

    def statistics(self) -> Any:
        every = [engine.statistics() for engine in self._engines]
        first = every[0]
        summed: dict[str, Any] = {}
        for name in first._fields:
            values = [getattr(stats, name) for stats in every]
            if isinstance(values[0], Sequence):
                length = max(len(value) for value in values)
                summed[name] = [
                    sum(value[i] for value in values if i < len(value)) for i in range(length)
                ]
            elif isinstance(values[0], float):
                summed[name] = sum(values) / len(values)
            else:
                summed[name] = sum(values)
        return type(first)(**summed)


def watch_engine(registry: CollectorRegistry, engine: Any) -> None:
    """Export a model engine's statistics in ``registry`` (llama's or vllm's)."""
    if hasattr(engine, "recent_steps"):
        watch_llama(registry, engine)
    else:
        watch_vllm(registry, engine)


def watch_vllm(registry: CollectorRegistry, engine: Any) -> None:
    """Export the vLLM engine's scheduler load (as vLLM last reported it) in ``registry``."""

    def load() -> EngineLoad:
        stats = engine.statistics()
        return EngineLoad(
            running=stats.running_requests,
            waiting=stats.waiting_requests,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            preemptions=stats.preemptions,
        )

    engine_metrics.watch_engine(registry, "vllm", load)


def watch_llama(registry: CollectorRegistry, *engines: Any, prefill: Sequence[Any] = ()) -> None:
    """Export the llama engines' statistics in ``registry``: batching and speculation of
    ``engines`` (the decode or aggregated ones, summed); KV tiers and transfers of all of
    them, ``prefill`` workers included."""

    def batching() -> BatchingCounts:
        stats = [engine.statistics() for engine in engines]
        return BatchingCounts(
            running=sum(s.running_sequences for s in stats),
            waiting=sum(s.waiting_sequences for s in stats),
            batch_sizes=[sum(sizes) for sizes in zip(*(s.batch_sizes for s in stats), strict=True)],
            prefill_tokens=sum(s.prefill_tokens for s in stats),
            cached_prompt_tokens=sum(s.cached_prompt_tokens for s in stats),
            decode_tokens=sum(s.decode_tokens for s in stats),
        )

    def speculation() -> tuple[int, int]:
        stats = [engine.statistics() for engine in engines]
        return sum(s.speculative_proposed for s in stats), sum(
            s.speculative_accepted for s in stats
        )

    def kv() -> KvCounts:
        stats = [engine.statistics() for engine in (*engines, *prefill)]
        return KvCounts(
            tier_hits=_sum_dicts(s.kv_tier_hits for s in stats),
            restored_tokens=_sum_dicts(s.kv_restored_tokens for s in stats),
            saved_blocks=_sum_dicts(s.kv_saved_blocks for s in stats),
            transferred_tokens=sum(s.transferred_tokens for s in stats),
            transferred_bytes=sum(s.transferred_bytes for s in stats),
            transfer_recomputed=sum(s.transfer_recomputed for s in stats),
            transfer_seconds=sum(s.transfer_seconds for s in stats),
        )

    engine_metrics.watch_speculation(registry, speculation)
    engine_metrics.watch_batching(registry, batching)
    engine_metrics.watch_kv(registry, kv)


def _sum_dicts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for each in counts:
        for key, value in each.items():
            total[key] = total.get(key, 0) + value
    return total
