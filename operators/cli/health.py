"""The health options of ``serve`` and ``worker`` (``--stall-timeout``,
``--canary-interval``, ``--engine-restarts``, ``--engine-restart-window``), and the one
way the command line puts an engine under watch: :func:`supervise`.

What is watched and why is :mod:`pipeline.health`'s; what a probe asks an LLM engine is
:mod:`operators.contracts.probe`'s. Here only the command line's words for them.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from operators.contracts.probe import one_token_probe
from pipeline.health import Supervised

from .defaults import (
    DEFAULT_CANARY_INTERVAL,
    DEFAULT_ENGINE_RESTARTS,
    DEFAULT_RESTART_WINDOW,
    DEFAULT_STALL_TIMEOUT,
)
from .options import non_negative_float, non_negative_int, positive_float

if TYPE_CHECKING:
    from pipeline import Engine

__all__ = ("HealthSettings", "add_health_options", "supervise")


class HealthSettings(Protocol):
    """What :func:`supervise` reads of a config (``ServeConfig``, ``WorkerConfig``)."""

    @property
    def stall_timeout(self) -> float: ...
    @property
    def canary_interval(self) -> float: ...
    @property
    def engine_restarts(self) -> int: ...
    @property
    def engine_restart_window(self) -> float: ...


def add_health_options(parser: argparse.ArgumentParser) -> None:
    """The health options, as a group of ``parser``."""
    group = parser.add_argument_group(
        "health",
        "How a stalled or dead engine is noticed and handled: GET /live, /ready and /health "
        "tell it, requests are refused at once (503, Retry-After) instead of hanging, and a "
        "dead engine is rebuilt in place.",
    )
    group.add_argument(
        "--stall-timeout",
        type=non_negative_float,
        default=DEFAULT_STALL_TIMEOUT,
        metavar="SECONDS",
        help=(
            "an engine with requests waiting that produces no output (and reports no work, "
            "as the llama engine's prefill chunks) for this long is stalled: its requests "
            "migrate or end with a 503, it is not ready until it answers again (0: never)"
        ),
    )
    group.add_argument(
        "--canary-interval",
        type=non_negative_float,
        default=DEFAULT_CANARY_INTERVAL,
        metavar="SECONDS",
        help=(
            "send an engine idle this long a one-token request; a failure or a stall marks "
            "it not ready, a success ready again (0: no canary)"
        ),
    )
    group.add_argument(
        "--engine-restarts",
        type=non_negative_int,
        default=DEFAULT_ENGINE_RESTARTS,
        metavar="N",
        help=(
            "rebuild an engine whose process or thread died at most N times within "
            "--engine-restart-window; past that /live answers 503 and the process exits "
            "with code 1 after its drain"
        ),
    )
    group.add_argument(
        "--freeze-after-tokens",
        type=non_negative_int,
        default=None,
        metavar="N",
        help=(
            "fault injection (mocker): the engine freezes after producing N tokens in all, "
            "as an engine stopped with SIGSTOP (what --stall-timeout is for)"
        ),
    )
    group.add_argument(
        "--engine-restart-window",
        type=positive_float,
        default=DEFAULT_RESTART_WINDOW,
        metavar="SECONDS",
        help="the window --engine-restarts counts over",
    )


def supervise(
    engine: Any,
    settings: HealthSettings,
    *,
    name: str,
    factory: Callable[[], Awaitable[Engine[Any, Any]]] | None = None,
    first_probe: bool = False,
) -> Supervised[Any, Any]:
    """``engine`` under watch as ``settings`` say, probed with one token; ``factory``
    rebuilds it when it dies (None: its death is beyond recovery); ``first_probe``: not
    ready until that token first comes back (a worker joining a fleet)."""
    if isinstance(engine, Supervised):
        return engine
    return Supervised(
        engine,
        factory=factory,
        name=name,
        stall_timeout=settings.stall_timeout or None,
        probe=one_token_probe,
        canary_interval=settings.canary_interval,
        restarts=settings.engine_restarts,
        restart_window=settings.engine_restart_window,
        first_probe=first_probe,
    )
