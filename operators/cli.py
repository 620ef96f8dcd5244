"""The ``llm-pipeline`` command line: ``llm-pipeline serve`` runs an OpenAI-compatible server.

::

    llm-pipeline serve [--host H] [--port P] [--engine echo] [--model-name NAME] ...

It builds the default graph (:func:`operators.graph.default_graph`: OpenAI preprocessor ->
Backend -> engine) with the bundled SmolLM2 tokenizer (or ``--tokenizer``) and the
embedded echo engine, so it needs no other service. Argument parsing happens here and
nowhere else; everything below takes plain constructor arguments.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import anyio

from operators.engines import DEFAULT_CYCLE_TOKENS, EchoEngine
from operators.engines.mocker import MockerEngine
from operators.graph import default_graph
from operators.llm import EngineOutput, PreprocessedRequest
from operators.openai.images import ImagePolicy
from operators.openai.metrics import ServerMetrics
from operators.openai.runner import serve
from operators.openai.server import OpenAIApp
from operators.tokenizer import Tokenizer
from pipeline import Engine, RoundRobin, Router, WorkerSet

__all__ = ("DEFAULT_MODEL_NAME", "build_graph", "build_parser", "main")

logger = logging.getLogger(__name__)

#: what the echo engine is served as unless ``--model-name`` says otherwise
DEFAULT_MODEL_NAME: Final = "echo"


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
            "EncoderRouter -> PrefillRouter -> engine). "
            "SIGINT/SIGTERM shut it down gracefully (in-flight streams end; exit code 0)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve_parser.add_argument(
        "--port", type=_port, default=8000, help="port to listen on (0: pick a free one)"
    )
    serve_parser.add_argument(
        "--engine",
        choices=["echo", "mocker"],
        default="echo",
        help=(
            "the engine: 'echo' streams each prompt's tokens back (no model needed); "
            "'mocker' simulates a worker's prefill/decode timing and plays every worker role"
        ),
    )
    serve_parser.add_argument(
        "--model-name",
        default=DEFAULT_MODEL_NAME,
        help="the model name clients must ask for (others get 404) and responses report",
    )
    serve_parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="PATH",
        help="tokenizer.json (or its directory) or a .gguf file (None: bundled SmolLM2)",
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
        "--echo-delay-ms",
        type=_non_negative_float,
        default=0.0,
        metavar="MS",
        help="echo engine: sleep this long before each token",
    )
    serve_parser.add_argument(
        "--echo-cycle",
        action="store_true",
        help=(
            "echo engine: repeat the prompt until max_tokens "
            f"({DEFAULT_CYCLE_TOKENS} tokens when a request sets none); for load tests"
        ),
    )
    serve_parser.add_argument(
        "--fail-after-tokens",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help=(
            "fault injection (echo, mocker): the first attempt of every request loses its "
            "worker (StreamDisconnected) after N tokens"
        ),
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
    mocker = serve_parser.add_argument_group("mocker engine")
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
    serve_parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help="log level of the server's messages on stderr",
    )
    return parser


def _load_tokenizer(path: Path | None) -> Tokenizer:
    if path is None:
        return Tokenizer.default()
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_file(path)


def _display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_Workers = WorkerSet[PreprocessedRequest, EngineOutput]


def _worker(args: argparse.Namespace, tokenizer: Tokenizer, role: str, index: int) -> Any:
    if args.engine == "echo":
        return EchoEngine.from_tokenizer(
            tokenizer,
            delay_ms=args.echo_delay_ms,
            cycle=args.echo_cycle,
            fail_after_tokens=args.fail_after_tokens,
        )
    return MockerEngine.from_tokenizer(
        tokenizer,
        role=role,
        worker_id=f"{role}-{index}",
        prefill_ms_per_token=args.mocker_prefill_ms_per_token,
        decode_ms_per_step=args.mocker_decode_ms_per_step,
        max_batch=args.mocker_max_batch,
        tokens=args.mocker_tokens,
        seed=args.mocker_seed,
        fail_after_tokens=args.fail_after_tokens,
    )


def _worker_set(
    args: argparse.Namespace, tokenizer: Tokenizer, role: str, count: int
) -> _Workers | None:
    if count == 0:
        return None
    return WorkerSet(role, {f"{role}-{i}": _worker(args, tokenizer, role, i) for i in range(count)})


def build_graph(
    args: argparse.Namespace, tokenizer: Tokenizer, metrics: ServerMetrics
) -> Engine[Any, dict[str, Any]]:
    """The default graph with the engine and worker sets that ``args`` ask for."""
    decode_role = "decode" if args.prefill_workers else "aggregated"
    decode = _worker_set(args, tokenizer, decode_role, args.decode_workers)
    assert decode is not None
    engine: Engine[PreprocessedRequest, EngineOutput] = (
        decode.members[0].engine if len(decode) == 1 else Router(decode, RoundRobin())
    )
    return default_graph(
        engine,
        tokenizer,
        model_name=args.model_name,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        migration_limit=args.migration_limit,
        on_migration=metrics.count_migration,
        encode_workers=_worker_set(args, tokenizer, "encode", args.encode_workers),
        prefill_workers=_worker_set(args, tokenizer, "prefill", args.prefill_workers),
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        images=ImagePolicy(
            allowed_hosts=frozenset(
                h.strip() for h in args.allowed_image_hosts.split(",") if h.strip()
            ),
            max_bytes=args.max_image_bytes,
        ),
    )


async def _serve(args: argparse.Namespace, tokenizer: Tokenizer) -> None:
    metrics = ServerMetrics()
    graph = build_graph(args, tokenizer, metrics)
    app = OpenAIApp(graph, model_name=args.model_name, metrics=metrics)

    def announce(host: str, port: int) -> None:
        print(
            f"llm-pipeline serving model {args.model_name!r} on "
            f"http://{_display_host(host)}:{port}",
            flush=True,
        )

    await serve(app, host=args.host, port=args.port, on_ready=announce, log_level=args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``llm-pipeline`` with ``argv`` (default: the process's); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.engine == "echo" and (args.prefill_workers or args.encode_workers):
        parser.error("--prefill-workers and --encode-workers need --engine mocker")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        try:
            tokenizer = _load_tokenizer(args.tokenizer)
        except Exception as exc:  # tokenizers raises plain Exception for a missing file
            print(f"llm-pipeline: cannot load the tokenizer: {exc}", file=sys.stderr)
            return 2
        anyio.run(_serve, args, tokenizer, backend="asyncio", backend_options={"use_uvloop": True})
    except KeyboardInterrupt:  # a Ctrl-C before the server installed its handlers
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
