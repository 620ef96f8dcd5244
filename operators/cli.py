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
from typing import Final

import anyio

from operators.engines import DEFAULT_CYCLE_TOKENS, EchoEngine
from operators.graph import default_graph
from operators.openai.runner import serve
from operators.openai.server import OpenAIApp
from operators.tokenizer import Tokenizer

__all__ = ("DEFAULT_MODEL_NAME", "build_parser", "main")

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
            "over the default graph (OpenAI preprocessor -> Backend -> engine). "
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
        choices=["echo"],
        default="echo",
        help="the engine: 'echo' streams each prompt's tokens back (no model needed)",
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
        help="tokenizer.json (or its directory) or a .gguf file; default: bundled SmolLM2",
    )
    serve_parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        metavar="N",
        help="context length: prompt plus output must fit (default: unlimited)",
    )
    serve_parser.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="output limit for requests that set none (default: none)",
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
            "echo engine, fault injection: the first attempt of every request loses its "
            "worker (StreamDisconnected) after N tokens"
        ),
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


async def _serve(args: argparse.Namespace, tokenizer: Tokenizer) -> None:
    engine = EchoEngine.from_tokenizer(
        tokenizer,
        delay_ms=args.echo_delay_ms,
        cycle=args.echo_cycle,
        fail_after_tokens=args.fail_after_tokens,
    )
    graph = default_graph(
        engine,
        tokenizer,
        model_name=args.model_name,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
    )
    app = OpenAIApp(graph, model_name=args.model_name)

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
