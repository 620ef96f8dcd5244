"""``llm-pipeline planner``: its arguments, its models file, and its typed config.

One *pool* per model and role: on the command line ``--model NAME`` (and ``--role``), or
one ``[[model]]`` table each in a ``--models`` file, parsed by this command's own parser on
top of the command line (as ``serve --models`` does): ``name`` is the model, every other
key a pool option's flag without its dashes::

    [[model]]
    name = "mocker"
    role = "prefill"
    ttft-p90-ms = 500
    max-workers = 4

    [[model]]
    name = "mocker"
    role = "decode"
    itl-p90-ms = 40
    worker-command = "llm-pipeline worker --nats {nats} --role decode ..."

The planner's own options (``--nats``, ``--host``, ``--port``, ``--interval``,
``--connector``, ``--drain-timeout``, the logs) belong on the command line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from operators.planner.local import check_template
from operators.planner.policy import Policy, Targets
from operators.planner.pools import PlannedPool

from .observability import LOG_FORMATS, LogFormat
from .options import add_log_level, non_negative_float, port, positive_float, positive_int
from .tables import read_tables, subparser

__all__ = (
    "CONNECTORS",
    "PLANNED_ROLES",
    "PLANNER_OPTIONS",
    "PlannerConfig",
    "add_planner_command",
    "check_planner_args",
    "planner_config",
)

#: the roles a planner can plan (encode workers have no latency target of their own)
PLANNED_ROLES: Final = ("aggregated", "prefill", "decode")
#: how the planner's decisions are carried out
CONNECTORS: Final = ("local",)
#: the planner's own options: never in a ``--models`` table
PLANNER_OPTIONS: Final = frozenset(
    {
        "nats",
        "host",
        "port",
        "interval",
        "connector",
        "drain-timeout",
        "log-level",
        "log-format",
        "models",
        "model",
    }
)

LogLevel = Literal["debug", "info", "warning", "error"]


def add_planner_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``planner`` command to ``llm-pipeline``'s commands."""
    parser = commands.add_parser(
        "planner",
        help="scale NATS workers to the load, per model and role, against latency targets",
        description=(
            "Keep each pool of workers (a model's workers in one role) as small as its "
            "latency targets allow: every --interval seconds it reads the p90 time to first "
            "token and inter-token latency the `serve --nats` frontends measured, and the "
            "load the workers report, then adds a worker when a target is missed (or the "
            "load per worker reaches one at which it was missed), or drains one when the "
            "others would carry the load with --headroom to spare; one step per interval "
            "at most, none within --cooldown of the last. A worker leaves by draining, "
            "never killed: told over NATS, it leaves discovery at once, finishes its "
            "streams within its drain timeout and hands the rest to Migration. With "
            "--connector local it runs the workers itself, from --worker-command, and "
            "restarts those that crash. /metrics, /status and /health on --host:--port. "
            "SIGINT/SIGTERM drain every worker it started, then it exits with code 0."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--nats",
        default=None,
        metavar="URL",
        help="the NATS server of the frontends and workers (required)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of /metrics and /status")
    parser.add_argument(
        "--port", type=port, default=8100, help="port of /metrics and /status (0: a free one)"
    )
    which = parser.add_argument_group(
        "what to plan", "One model and role (--model), or every [[model]] table of --models."
    )
    which.add_argument("--model", default=None, metavar="NAME", help="the model to plan")
    which.add_argument(
        "--models",
        type=Path,
        default=None,
        metavar="FILE",
        help=(
            "plan several pools: a TOML file of [[model]] tables, each with its name and "
            "the pool options below under their flags' names (role, ttft-p90-ms, "
            "min-workers, worker-command, ...); options given here apply to every table "
            "that does not set its own"
        ),
    )
    pool = parser.add_argument_group(
        "a pool's targets and bounds",
        "A prefill pool answers for the TTFT, a decode pool for the inter-token latency, "
        "an aggregated pool for both (give either or both targets).",
    )
    pool.add_argument(
        "--role",
        choices=PLANNED_ROLES,
        default="aggregated",
        help="the workers' role (prefill and decode: disaggregated serving, planned apart)",
    )
    pool.add_argument(
        "--ttft-p90-ms",
        type=positive_float,
        default=None,
        metavar="MS",
        help="target: 90 %% of requests get their first token within MS milliseconds",
    )
    pool.add_argument(
        "--itl-p90-ms",
        type=positive_float,
        default=None,
        metavar="MS",
        help="target: 90 %% of the gaps between a stream's tokens are within MS milliseconds",
    )
    pool.add_argument(
        "--min-workers", type=positive_int, default=1, metavar="N", help="never fewer workers"
    )
    pool.add_argument(
        "--max-workers", type=positive_int, default=8, metavar="N", help="never more workers"
    )
    pool.add_argument(
        "--headroom",
        type=_headroom,
        default=0.2,
        metavar="FRACTION",
        help=(
            "a step down must leave this share of the learned capacity unused (0 <= FRACTION < 1)"
        ),
    )
    pool.add_argument(
        "--cooldown",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="no change within this long of the last one (the fleet settles in between)",
    )
    pool.add_argument(
        "--worker-command",
        default=None,
        metavar="TEMPLATE",
        help=(
            "--connector local: the shell command that starts one worker, with the fields "
            "{model}, {role}, {worker_id} (required: pass --worker-id {worker_id}), {nats} "
            "and {drain_timeout} (Python's format syntax; values are shell-quoted), e.g. "
            '"llm-pipeline worker --nats {nats} --model-name {model} --role {role} '
            '--worker-id {worker_id} --drain-timeout {drain_timeout}"'
        ),
    )
    planning = parser.add_argument_group("planning")
    planning.add_argument(
        "--interval",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="how often it decides (and how long the latencies and loads it judges span)",
    )
    planning.add_argument(
        "--connector",
        choices=CONNECTORS,
        default="local",
        help="how decisions are carried out: local runs the workers as processes here",
    )
    planning.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help=(
            "how long a leaving worker may drain ({drain_timeout} of --worker-command); one "
            "still there 10 s after that is killed"
        ),
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="json: each log record as one JSON object per line on stderr",
    )
    add_log_level(parser, "planner (a line per decision at info)", default="info")


def _headroom(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def check_planner_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check of one pool's options (exits with code 2)."""
    if args.nats is None:  # (not argparse's required=: a --models table gives none)
        parser.error("the planner needs the NATS server of its workers: --nats URL")
    if (args.model is None) == (getattr(args, "models", None) is None):
        if args.model is None:
            parser.error("give --model NAME (one pool) or --models FILE (several)")
        parser.error("--models names each model in the file: drop --model")
    if args.model is None:
        return  # the file's tables are checked one by one
    if args.ttft_p90_ms is None and args.itl_p90_ms is None:
        parser.error("give a target: --ttft-p90-ms, --itl-p90-ms or both")
    if args.role == "prefill" and args.ttft_p90_ms is None:
        parser.error("a prefill pool answers for the TTFT: give --ttft-p90-ms")
    if args.role == "decode" and args.itl_p90_ms is None:
        parser.error("a decode pool answers for the inter-token latency: give --itl-p90-ms")
    if args.max_workers < args.min_workers:
        parser.error(
            f"--max-workers ({args.max_workers}) must be >= --min-workers ({args.min_workers})"
        )
    if args.connector == "local":
        if args.worker_command is None:
            parser.error("--connector local runs workers: give --worker-command TEMPLATE")
        try:
            check_template(args.worker_command)
        except ValueError as exc:
            parser.error(f"argument --worker-command: {exc}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """What ``llm-pipeline planner`` was asked for."""

    nats: str
    pools: tuple[PlannedPool, ...]
    #: each pool's worker command (``--connector local``), by (model, role)
    commands: dict[tuple[str, str], str]
    host: str = "127.0.0.1"
    port: int = 8100
    interval: float = 10.0
    connector: str = "local"
    drain_timeout: float = 10.0
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"


def planner_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PlannerConfig:
    """The planner's config from its arguments (each pool's from the models file, if any).

    Raises:
        ValueError: the models file cannot be read, or a table is wrong (one line naming
            the file, the model and the option).
    """
    if args.models is not None:
        command = subparser(parser, "planner")
        tables = read_tables(
            args.models,
            command,
            args,
            whole=PLANNER_OPTIONS,
            owner="planner",
            name_flag="--model",
            check=lambda namespace: check_planner_args(command, namespace),
            key=lambda namespace: (namespace.model, namespace.role),
        )
    else:
        tables = [args]
    pools = tuple(_pool(table) for table in tables)
    return PlannerConfig(
        nats=args.nats,
        pools=pools,
        commands={(t.model, t.role): t.worker_command for t in tables if t.worker_command},
        host=args.host,
        port=args.port,
        interval=args.interval,
        connector=args.connector,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def _pool(args: argparse.Namespace) -> PlannedPool:
    policy = Policy(
        targets=Targets(
            ttft_p90=None if args.ttft_p90_ms is None else args.ttft_p90_ms / 1000,
            itl_p90=None if args.itl_p90_ms is None else args.itl_p90_ms / 1000,
        ),
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        headroom=args.headroom,
        cooldown=args.cooldown,
    )
    return PlannedPool(model=args.model, role=args.role, policy=policy)
