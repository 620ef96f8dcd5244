"""``main``: parse, check, turn the arguments into a typed config, load the tokenizer, and
run ``serve`` or ``worker`` on uvloop (``convert-gguf`` needs neither, ``planner`` no
tokenizer). Exit codes: 0 after a graceful shutdown, 1 when a service or the engine is
unavailable, 2 for a usage error or an unloadable tokenizer."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from operators.text.tokenizer import Tokenizer

from .args import build_parser, check_args
from .config import ServeConfig, WorkerConfig
from .defaults import MODEL_ENGINES, TRANSFER_SECRET_ENV
from .engines import load_tokenizer
from .models_file import read_models_file
from .nats import OneLineErrors
from .observability import configure_logging
from .planner_args import planner_config
from .serve import run_serve
from .tuning import tune_gc, tune_threads
from .worker import run_worker

__all__ = ("convert", "main", "plan")

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``llm-pipeline`` with ``argv`` (default: the process's); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    check_args(parser, args)
    if args.command == "convert-gguf":
        return convert(args.gguf, args.directory)
    if args.command == "planner":
        return plan(parser, args)
    config: ServeConfig | WorkerConfig
    if args.command == "serve":
        try:
            models = [] if args.models is None else read_models_file(args.models, parser, args)
        except ValueError as exc:
            print(f"llm-pipeline: {exc}", file=sys.stderr)
            return 2
        config = ServeConfig.from_args(args, models)
    else:
        config = WorkerConfig.from_args(args)
    configure_logging(config.log_level, config.log_format)
    if config.log_level != "debug":
        logging.getLogger("nats.aio.client").addFilter(OneLineErrors())
    if (
        isinstance(config, WorkerConfig)
        and config.engine.engine == "mocker"
        and config.role in ("prefill", "decode")
        and config.engine.transfer_secret is None
    ):
        logger.warning(
            "a %s worker without --transfer-secret (or %s) signs or verifies transfer handles "
            "with a secret of its own process: its peers in other processes will reject them",
            config.role,
            TRANSFER_SECRET_ENV,
        )
    try:
        tokenizer: Tokenizer | None = None
        # (a worker of a real model serves token ids: the tokenizer is the frontend's)
        if not (isinstance(config, WorkerConfig) and config.engine.engine in MODEL_ENGINES):
            try:
                tokenizer = load_tokenizer(config.engine.tokenizer_path)
            except Exception as exc:  # tokenizers raises plain Exception for a missing file
                print(f"llm-pipeline: cannot load the tokenizer: {exc}", file=sys.stderr)
                return 2
        tune_gc()
        tune_threads()
        options = {"use_uvloop": True}
        code: int
        if isinstance(config, ServeConfig):
            assert tokenizer is not None
            code = anyio.run(
                run_serve, config, tokenizer, backend="asyncio", backend_options=options
            )
        else:
            code = anyio.run(
                run_worker, config, tokenizer, backend="asyncio", backend_options=options
            )
    except KeyboardInterrupt:  # a Ctrl-C before the server installed its handlers
        return 128 + signal.SIGINT
    return code


def plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``llm-pipeline planner ...``; the exit code."""
    from .planner import run_planner

    try:
        config = planner_config(parser, args)
    except ValueError as exc:
        print(f"llm-pipeline: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    if config.log_level != "debug":
        logging.getLogger("nats.aio.client").addFilter(OneLineErrors())
    options = {"use_uvloop": True}
    try:
        return anyio.run(run_planner, config, backend="asyncio", backend_options=options)
    except KeyboardInterrupt:  # a Ctrl-C before the planner installed its handlers
        return 128 + signal.SIGINT


def convert(gguf: Path, directory: Path) -> int:
    """``llm-pipeline convert-gguf GGUF DIR``; the exit code (1: it could not be converted)."""
    from operators.engines.vllm.model_dir import convert_gguf

    if not gguf.is_file():
        print(f"llm-pipeline: no such GGUF file: {gguf}", file=sys.stderr)
        return 1
    try:
        convert_gguf(gguf, directory)
    except (ImportError, ValueError, OSError) as exc:
        print(f"llm-pipeline: cannot convert {gguf}: {exc}", file=sys.stderr)
        return 1
    print(f"llm-pipeline: wrote {directory} (for --engine vllm --model {directory})", flush=True)
    return 0
