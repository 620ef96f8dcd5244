"""``serve``'s keys: the :class:`~operators.edges.http.guard.Guard` of its options, the
keys file reloaded on SIGHUP, and the budgets shared over NATS.

``--api-keys FILE`` is read at start (a bad file: exit code 2, the error naming the line);
on SIGHUP it is read again and replaces the keys of the file (``--api-key`` flags stay),
between two requests: the ones in flight finish on the terms they were admitted with. A
file that cannot be used then is logged, naming the line, and the keys stay as they were.
With ``--nats`` the keys' budgets live in a JetStream bucket every frontend shares
(:mod:`operators.edges.http.nats_budgets`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from operators.edges.http.guard import Guard
from operators.edges.http.tenants import Tenants, load_tenants

from .config import ServeConfig, key_priorities

if TYPE_CHECKING:
    from nats.aio.client import Client

    from operators.edges.http.budgets import Budgets

__all__ = ("guard", "open_budgets", "reloader")

logger = logging.getLogger("operators.cli.serve")


def guard(config: ServeConfig) -> Guard:
    """The protections ``serve`` was asked for (the keys' use kept in this process: with
    NATS, set its ``budgets`` to :func:`open_budgets`'s).

    Raises:
        ValueError: the keys file cannot be used (naming the line), or a key is given twice.
    """
    tenants = None if config.api_keys_file is None else load_tenants(config.api_keys_file)
    return Guard(
        api_keys=key_priorities(config.api_keys),
        max_inflight=config.max_inflight,
        max_queued=config.max_queued,
        request_timeout=config.request_timeout,
        admin_keys=config.admin_api_key,
        allowed_origins=config.allowed_origins,
        tenants=tenants,
    )


def reloader(path: Path, guard: Guard) -> Callable[[], None]:
    """What SIGHUP does: read the keys file at ``path`` again into ``guard``."""

    def reload() -> None:
        try:
            tenants: Tenants = load_tenants(path)
            guard.reload(tenants)
        except ValueError as exc:  # (a KeysFileError names the line)
            logger.error("SIGHUP: the keys stay as they were: %s", exc)
            return
        logger.info("SIGHUP: reloaded %s (%d keys)", path, len(tenants))

    return reload


async def open_budgets(nc: Client, stack: contextlib.AsyncExitStack) -> Budgets:
    """The keys' budgets in NATS (their heartbeat running until ``stack`` unwinds).

    Raises:
        Exception: nats-py's errors, a server without JetStream.
    """
    from operators.edges.http.nats_budgets import NatsBudgets

    budgets = await NatsBudgets.open(nc)
    tg = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(tg.cancel_scope.cancel)
    await tg.start(budgets.run)
    return budgets
