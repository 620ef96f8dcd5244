"""The typed configuration of ``serve`` and ``worker``: what the command line asked for.

argparse gives a ``Namespace`` of untyped attributes; everything after parsing takes these
frozen dataclasses instead, so the graph, engine and lifecycle code is type-checked and
can be driven from Python without building a command line. ``from_args`` is the one
place that reads a ``Namespace`` and the environment (API keys, the transfer secret);
the defaults here are the parser's (a test keeps them equal). The llama engine's own
options are one :class:`~operators.engines.llama.LlamaOptions` (:func:`llama_options`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from operators.engines.echo import TOKENS_PER_TURN
from operators.engines.llama import LlamaOptions, NgramSpeculation

from .defaults import (
    API_KEY_ENV,
    DEFAULT_CANARY_INTERVAL,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_ENGINE_RESTARTS,
    DEFAULT_LLAMA_MODEL_NAME,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_RESPONSES_STORE_MB,
    DEFAULT_RESPONSES_STORE_TTL,
    DEFAULT_RESTART_WINDOW,
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_UPSTREAM_POLL_MS,
    DEFAULT_UPSTREAM_TIMEOUT,
    TRANSFER_SECRET_ENV,
    EchoMode,
    EngineName,
    Role,
    RouterName,
)
from .observability import LogFormat

if TYPE_CHECKING:
    from operators.graph import Point

__all__ = (
    "EngineConfig",
    "LogLevel",
    "ServeConfig",
    "WorkerConfig",
    "key_priorities",
    "llama_options",
)

LogLevel = Literal["debug", "info", "warning", "error"]


#: the most a priority may be either way (as the edge bounds a request's ``priority``)
_MAX_PRIORITY = 2**31 - 1


def key_priorities(keys: Sequence[str]) -> dict[str, int]:
    """``--api-key`` values (``KEY`` or ``KEY:PRIORITY``) as key -> default priority (0 when
    a key gives none; a key that ends in ``:`` and an integer is read as ``KEY:PRIORITY``).

    Raises:
        ValueError: a priority out of bounds, or an empty key.
    """
    found: dict[str, int] = {}
    for text in keys:
        key, priority = text, 0
        head, sep, tail = text.rpartition(":")
        if sep and tail.lstrip("+-").isdigit():
            key, priority = head, int(tail)
            if not -_MAX_PRIORITY <= priority <= _MAX_PRIORITY:
                raise ValueError(f"the priority of an API key must be within ±{_MAX_PRIORITY}")
        if not key.strip():
            raise ValueError("an API key must not be empty")
        found[key] = priority
    return found


def llama_options(args: argparse.Namespace) -> LlamaOptions:
    """The llama engine's options its flags give in ``args`` (the others are its defaults,
    set when an engine is loaded: :func:`operators.cli.engines.load_llama`).

    Raises:
        LlamaOptionError: a value out of range (``check_args`` makes it a usage error).
    """
    speculative = None
    if args.speculative == "ngram":
        speculative = NgramSpeculation(
            ngram_size=args.ngram_size, num_draft_tokens=args.draft_tokens
        )
    return LlamaOptions(
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        parallel=args.parallel,
        step_tokens=args.step_tokens,
        step_ms=args.step_ms,
        speculative=speculative,
        kv_host_cache_mb=args.kv_host_cache_mb,
        kv_disk_cache=args.kv_disk_cache,
        kv_disk_cache_mb=args.kv_disk_cache_mb,
        transfer_host=args.kv_transfer_host,
        transfer_timeout=args.kv_transfer_timeout,
    )


def _fields_from(cls: type[Any], args: argparse.Namespace, **given: Any) -> dict[str, Any]:
    """``cls``'s fields from ``args`` (by name), except those ``given``."""
    names = (f.name for f in dataclasses.fields(cls) if f.init and f.name not in given)
    return {**{name: getattr(args, name) for name in names}, **given}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine options ``serve`` and ``worker`` share (``--engine`` and its groups)."""

    engine: EngineName = "echo"
    #: the served name; None: the engine's name for echo and mocker, or for llama and vllm
    #: the default model's or --model's name
    model_name: str | None = None
    tokenizer: Path | None = None
    fail_after_tokens: int | None = None
    #: fault injection (mocker): the engine freezes after this many tokens in all
    freeze_after_tokens: int | None = None
    echo_delay_ms: float = 0.0
    echo_cycle: bool = False
    echo_tokens_per_turn: int = TOKENS_PER_TURN
    model: Path | None = None
    #: the llama engine's options from its flags (--parallel, --step-tokens, ...); its
    #: block size, adapters and transfer secret are this config's (``kv_block_size``,
    #: ``lora``, ``transfer_secret``: other engines take them too), set when it is loaded
    llama: LlamaOptions = field(default_factory=LlamaOptions)
    mocker_prefill_ms_per_token: float = 0.05
    mocker_decode_ms_per_step: float = 5.0
    mocker_decode_ms_per_sequence: float = 0.0
    mocker_max_batch: int = 64
    mocker_tokens: Literal["echo", "random"] = "echo"
    mocker_seed: int = 0
    #: prefix-cache blocks per mocker; None: DEFAULT_CACHE_BLOCKS under --router kv, else 0
    mocker_cache_blocks: int | None = None
    #: tokens per KV block: the mockers' cache and the KV router must agree
    kv_block_size: int = 16
    #: vLLM's options (None: vLLM's default, or the CPU build's, see operators.engines.vllm)
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    block_size: int | None = None
    #: None: a secret of this process (``from_args`` reads LLM_PIPELINE_TRANSFER_SECRET)
    transfer_secret: str | None = None
    #: adapters (LoRA) to load: (served name, file or folder)
    lora: tuple[tuple[str, Path], ...] = ()
    #: --engine remote: the upstream servers, as given (``URL[,kv=tcp://HOST:PORT]``)
    upstream: tuple[str, ...] = ()
    #: what the upstreams are (None: each is asked)
    upstream_kind: Literal["vllm", "llama-server"] | None = None
    upstream_poll_ms: float = DEFAULT_UPSTREAM_POLL_MS
    #: the longest silence of an upstream's stream before it counts as lost
    upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT

    @property
    def served_name(self) -> str:
        """The model name clients ask for and responses report."""
        if self.model_name is not None:
            return self.model_name
        if self.engine == "remote":
            return ""  # the upstream's: known once connected (``serve`` and ``worker`` ask it)
        if self.engine == "vllm":
            return DEFAULT_LLAMA_MODEL_NAME if self.model is None else self.model.name
        if self.engine == "llama":
            return DEFAULT_LLAMA_MODEL_NAME if self.model is None else self.model.stem
        return self.engine  # echo and mocker have no model: they are served as themselves

    @property
    def tokenizer_path(self) -> Path | None:
        """The tokenizer to load (None: SmolLM2's, shipped): llama's and vllm's are the
        model's own (the GGUF's, the folder's tokenizer.json), and so is remote's when it
        is given one (``--model``: the upstream's model, here)."""
        if self.tokenizer is None and self.engine in ("llama", "vllm", "remote"):
            return self.model
        return self.tokenizer

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The engine options in ``args``; the transfer secret from the environment if
        ``--transfer-secret`` was not given."""
        secret = args.transfer_secret
        if secret is None:
            secret = os.environ.get(TRANSFER_SECRET_ENV) or None
        return cls(
            **_fields_from(
                cls,
                args,
                llama=llama_options(args),
                transfer_secret=secret,
                lora=tuple(getattr(args, "lora", None) or ()),
                upstream=tuple(getattr(args, "upstream", None) or ()),
            )
        )


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What ``llm-pipeline serve`` was asked for."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None
    default_max_tokens: int | None = None
    migration_limit: int = 3
    decode_workers: int = 1
    #: how a request picks one of the in-process decode/aggregated workers
    router: RouterName = "round-robin"
    #: --router kv's cost of a prompt token to prefill, against one of queued work
    kv_overlap_weight: float = 2.0
    kv_restore_cost: float = 0.1
    #: --router kv's prompt tokens one sequence a worker holds is worth
    kv_decode_weight: float = 16.0
    #: --router kv: a busy worker over this many times its share is passed over for an idle one
    router_balance: float = 1.5
    router_temperature: float = 0.0
    #: seconds a conversation (``prompt_cache_key``, ``x-session-affinity``) sticks to its
    #: worker after its last request (0: never)
    affinity_ttl: float = 300.0
    prefill_workers: int = 0
    encode_workers: int = 0
    disagg_min_prompt_tokens: int = 0
    nats: str | None = None
    worker_wait: float = 5.0
    allowed_image_hosts: frozenset[str] = frozenset()
    max_image_bytes: int = 8 * 1024 * 1024
    #: as given: ``KEY``, or ``KEY:PRIORITY`` for the key's default priority
    #: (:func:`key_priorities`)
    api_keys: tuple[str, ...] = ()
    #: keys that may also see every key's requests in the status view (API keys too)
    admin_api_key: tuple[str, ...] = ()
    #: ``--api-keys FILE``: the keys with their terms (:mod:`operators.edges.http.tenants`)
    api_keys_file: Path | None = None
    #: web origins whose pages may call the server from a browser (CORS; ``*``: any)
    allowed_origins: tuple[str, ...] = ()
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_inflight: int | None = None
    #: generation requests that may wait for a slot of max_inflight
    max_queued: int = 0
    request_timeout: float | None = None
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    log_level: LogLevel = "warning"
    #: operators to insert, as (point, ``MODULE:NAME``), loaded when the graph is built
    insert_before: tuple[tuple[Point, str], ...] = ()
    #: a Jinja chat template file replacing the model's
    chat_template: Path | None = None
    #: the echo engine's answer: the rendered prompt, or the last message's text alone
    echo: EchoMode = "prompt"
    #: the tool-call format: a registered name or ``MODULE:NAME`` (None: no tool calls)
    tool_call_parser: str | None = "hermes"
    #: the reasoning format: a registered name or ``MODULE:NAME`` (None: none)
    reasoning_parser: str | None = None
    #: the Responses API's store: megabytes kept, and seconds each response is kept
    responses_store_mb: int = DEFAULT_RESPONSES_STORE_MB
    responses_store_ttl: float = DEFAULT_RESPONSES_STORE_TTL
    #: where spans are exported over OTLP/HTTP (None: the environment's, if any)
    otlp_traces_endpoint: str | None = None
    #: json: log records as JSON lines, and one line per request
    log_format: LogFormat = "text"
    #: serve the web UI at / (and /status)
    ui: bool = True
    #: the only folder adapters may be loaded from at run time (None: any)
    lora_dir: Path | None = None
    #: the health options (:mod:`.health`): stalls, the canary, rebuilds of a dead engine
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    canary_interval: float = DEFAULT_CANARY_INTERVAL
    engine_restarts: int = DEFAULT_ENGINE_RESTARTS
    engine_restart_window: float = DEFAULT_RESTART_WINDOW
    #: ``--models FILE``: one config per model (its engine and graph options; the
    #: server's own options are this config's); empty: the one model of ``engine``
    models: tuple[ServeConfig, ...] = ()

    @property
    def model_name(self) -> str:
        """The served model name (the engine config's)."""
        return self.engine.served_name

    @property
    def served(self) -> tuple[ServeConfig, ...]:
        """One config per model served: :attr:`models`, or this one."""
        return self.models or (self,)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, models: Sequence[argparse.Namespace] = ()
    ) -> ServeConfig:
        """The config of ``serve`` from its parsed arguments; API keys from ``--api-key``
        and the environment; ``models``: each model's arguments (``--models FILE``)."""
        keys = list(args.api_key or ())
        from_env = os.environ.get(API_KEY_ENV, "").strip()
        if from_env:
            keys.append(from_env)
        hosts = frozenset(h.strip() for h in args.allowed_image_hosts.split(",") if h.strip())
        return cls(
            **_fields_from(
                cls,
                args,
                engine=EngineConfig.from_args(args),
                allowed_image_hosts=hosts,
                api_keys=tuple(keys),
                admin_api_key=tuple(getattr(args, "admin_api_key", None) or ()),
                allowed_origins=tuple(getattr(args, "allowed_origins", None) or ()),
                insert_before=tuple(getattr(args, "insert_before", None) or ()),
                tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
                models=tuple(cls.from_args(model) for model in models),
            )
        )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What ``llm-pipeline worker`` was asked for."""

    nats: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    role: Role = "aggregated"
    #: None: ``ROLE-<random>``, chosen when the config is made
    worker_id: str | None = None
    drain_timeout: float = 10.0
    log_level: LogLevel = "warning"
    #: where spans are exported over OTLP/HTTP (None: the environment's, if any)
    otlp_traces_endpoint: str | None = None
    #: json: log records as JSON lines
    log_format: LogFormat = "text"
    #: the health options (:mod:`.health`): stalls, the canary, rebuilds of a dead engine
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    canary_interval: float = DEFAULT_CANARY_INTERVAL
    engine_restarts: int = DEFAULT_ENGINE_RESTARTS
    engine_restart_window: float = DEFAULT_RESTART_WINDOW

    def __post_init__(self) -> None:
        if self.worker_id is None:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")

    @property
    def model_name(self) -> str:
        """The served model name (the engine config's)."""
        return self.engine.served_name

    @property
    def id(self) -> str:
        """This worker's id in discovery and logs."""
        assert self.worker_id is not None  # (__post_init__)
        return self.worker_id

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """The config of ``worker`` from its parsed arguments."""
        return cls(**_fields_from(cls, args, engine=EngineConfig.from_args(args)))
