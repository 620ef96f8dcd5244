"""How a llama engine runs: :class:`LlamaOptions`, one frozen value, checked once.

``LlamaEngine(path, options=LlamaOptions(parallel=8, step_tokens=256))``. The same object is
what the command line builds from its llama flags (``operators.cli``: their defaults are
these, and a bad value is a usage error naming the flag, from the same check), so this
module needs nothing of the ``[llama]`` extra: importing it, or ``operators.engines.llama``
for it, never loads llama.cpp or numpy.

What the engine is connected to rather than how it runs (a KV event sink, KV tier objects)
is not an option: :class:`~operators.engines.llama.LlamaEngine` takes those itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, final

from operators.engines._prefix_cache import DEFAULT_BLOCK_SIZE
from operators.engines.ngram import NgramSpeculation

__all__ = (
    "DEFAULT_N_CTX",
    "DEFAULT_PARALLEL",
    "DEFAULT_STEP_MS",
    "DEFAULT_STEP_TOKENS",
    "DEFAULT_TRANSFER_TIMEOUT",
    "LlamaOptionError",
    "LlamaOptions",
    "Role",
    "parallel_for",
    "usable_cpus",
)

#: the context window of one sequence by default
DEFAULT_N_CTX: Final = 2048


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container's cpuset limits),
    else every CPU the machine has."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def parallel_for(cpus: int) -> int:
    """The slots (sequences decoded together) a machine of ``cpus`` CPUs gets by default:
    four a CPU, between 4 and 16.

    On a CPU a decode step's cost is mostly reading the weights, which a batch shares, so
    more slots cost little per step and spare requests a wait for a slot: on two cores,
    ``--parallel 8`` gave the most tokens/s at c=1, 4 and 8, while with 4 slots the fifth
    request waited a whole answer (TTFT p99 3.2 s at c=8; ``benchmarks/bench_llama_http.py``,
    issue 36's table). Past 16 the KV cache (``parallel * n_ctx`` cells) outgrows what a CPU
    host serving one model usually gives it, and one step's batch grows long enough to be
    felt between tokens.
    """
    return min(max(4 * cpus, 4), 16)


#: sequences decoded together by default: :func:`parallel_for` this machine's CPUs (8 on
#: two)
DEFAULT_PARALLEL: Final = parallel_for(usable_cpus())
#: tokens one step evaluates at most, by default: ~0.4 s of prefill on two cores for
#: SmolLM2, so running sequences never wait longer than that for their next token
DEFAULT_STEP_TOKENS: Final = 128
#: milliseconds a step beside decoding sequences should take, by default (prompt chunks are
#: sized to it): on two cores about three decode steps, so a new prompt delays the running
#: answers by tens of ms per token instead of a 128-token chunk's ~0.4 s
DEFAULT_STEP_MS: Final = 60.0
#: seconds a decode worker waits for a prefill worker's cells before prefilling itself
DEFAULT_TRANSFER_TIMEOUT: Final = 10.0
#: the least ``step_tokens`` may be (and at least ``parallel``)
_MIN_STEP_TOKENS: Final = 16
#: the least ``n_ctx`` may be
_MIN_N_CTX: Final = 16

Role = Literal["aggregated", "prefill", "decode"]
"""What a llama worker does for a request: everything; the prompt and one token, keeping
the cells for a decode worker; or (also) continuing a prefill worker's request."""


class LlamaOptionError(ValueError):
    """A :class:`LlamaOptions` value out of range: :attr:`option` is the field, and
    :attr:`problem` what is wrong with its value (the message is both)."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.option = option
        self.problem = problem


@final
@dataclass(frozen=True, kw_only=True)
class LlamaOptions:
    """The options of a :class:`~operators.engines.llama.LlamaEngine` (all have defaults).

    Raises:
        LlamaOptionError: a value out of range (a ``ValueError`` naming the option). What
            depends on llama.cpp's build (``parallel`` at most its
            ``llama_max_parallel_sequences``) is checked when the engine loads.
    """

    #: the context window of one sequence in tokens: a request's prompt + max_tokens must
    #: fit. The KV cache holds ``parallel * n_ctx`` cells. At least 16.
    n_ctx: int = DEFAULT_N_CTX
    #: CPU threads for llama.cpp (None: every CPU this process may use)
    n_threads: int | None = None
    #: sequences decoded together (slots); more requests wait for a slot, by priority then
    #: arrival (``PreprocessedRequest.priority``, lower first, with :mod:`pipeline.priority`'s
    #: aging)
    parallel: int = DEFAULT_PARALLEL
    #: most tokens one step evaluates while sequences decode: a token of every decoding
    #: sequence, then chunks of pending prompts, then drafts. At least ``parallel`` and 16.
    #: While none decodes, a step takes up to 512 prompt tokens.
    step_tokens: int = DEFAULT_STEP_TOKENS
    #: while sequences decode, size prompt chunks so that a step takes about this many
    #: milliseconds (learnt from the steps run; 0: by ``step_tokens`` alone): bounds the
    #: inter-token latency a new prompt causes the running sequences (docs/llama.md,
    #: "Concurrency")
    step_ms: float = DEFAULT_STEP_MS
    #: prompt-lookup speculative decoding for greedy requests (None: off)
    speculative: NgramSpeculation | None = None
    #: tokens per KV block in the KV events (the KV router's block size)
    block_size: int = DEFAULT_BLOCK_SIZE
    #: ``"aggregated"`` serves everything; ``"prefill"`` answers one token with a transfer
    #: handle and keeps the prompt's KV for a decode worker to pull; ``"decode"`` (and
    #: ``"aggregated"``) continue a request carrying a handle from the pulled KV
    #: (docs/llama.md, "Disaggregated serving")
    role: Role = "aggregated"
    #: this worker's name in the handles it issues
    worker_id: str = "llama"
    #: the key handles are signed and transfers authenticated with; prefill and decode
    #: workers must share it (None: a secret of this process)
    transfer_secret: bytes | None = None
    #: the address a prefill worker serves its KV on (port: any free)
    transfer_host: str = "127.0.0.1"
    #: seconds a decode worker waits for KV before prefilling itself
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    #: a :class:`~pipeline.MemoryKvTier` of this many MiB in front of the engine's
    #: ``kv_tiers`` (0: none): a slot's blocks go there before its cells are overwritten,
    #: and a new prompt's blocks found there are restored instead of prefilled
    kv_host_cache_mb: int = 0
    #: a directory for a :class:`~pipeline.DiskKvTier` of ``kv_disk_cache_mb`` MiB below
    #: the other tiers (its blocks are kept apart per model and layout; None: none)
    kv_disk_cache: str | Path | None = None
    kv_disk_cache_mb: int = 1024
    #: adapters (LoRA) to load, by name: llama.cpp adapter GGUFs of the model. A request
    #: naming one (``PreprocessedRequest.lora``) runs with it; more load at run time
    #: (:meth:`~operators.engines.llama.LlamaEngine.load_lora`). docs/llama.md, "Adapters
    #: (LoRA)"
    loras: Mapping[str, str | Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_ctx < _MIN_N_CTX:
            raise LlamaOptionError("n_ctx", f"must be >= {_MIN_N_CTX}, got {self.n_ctx}")
        if self.n_threads is not None and self.n_threads < 1:
            raise LlamaOptionError("n_threads", f"must be >= 1, got {self.n_threads}")
        if self.parallel < 1:
            raise LlamaOptionError("parallel", f"must be >= 1, got {self.parallel}")
        if self.step_tokens < max(self.parallel, _MIN_STEP_TOKENS):
            raise LlamaOptionError(
                "step_tokens",
                f"must be >= parallel ({self.parallel}) and >= {_MIN_STEP_TOKENS}, got "
                f"{self.step_tokens}: every step carries a token of each running sequence",
            )
        if not self.step_ms >= 0:  # also NaN
            raise LlamaOptionError("step_ms", f"must be >= 0, got {self.step_ms}")
        if self.block_size < 1:
            raise LlamaOptionError("block_size", f"must be >= 1, got {self.block_size}")
        if self.role not in ("aggregated", "prefill", "decode"):
            raise LlamaOptionError(
                "role", f"must be 'aggregated', 'prefill' or 'decode', got {self.role!r}"
            )
        if not self.transfer_timeout > 0:  # also NaN
            raise LlamaOptionError(
                "transfer_timeout", f"must be a number of seconds > 0, got {self.transfer_timeout}"
            )
        for name in ("kv_host_cache_mb", "kv_disk_cache_mb"):
            if getattr(self, name) < 0:
                raise LlamaOptionError(name, f"must be >= 0, got {getattr(self, name)}")
