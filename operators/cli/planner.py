"""``llm-pipeline planner``: plan the pools until SIGINT/SIGTERM, then drain their workers.

Once it plans it prints ``llm-pipeline planner on http://HOST:PORT planning POOLS via URL``;
``/metrics``, ``/status`` and ``/health`` answer there. A first signal stops the planning
and drains every worker the planner started (the connector's exit: SIGTERM, each worker
given the drain timeout), then the planner exits with code 0; a second signal kills what
is left at once.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator

import anyio

from operators.planner.http import CannotListen, PlannerApp, listen, serve_http
from operators.planner.local import LocalConnector
from operators.planner.metrics import PlannerMetrics

from .nats import close_nats, connect_nats, one_line
from .planner_args import PlannerConfig

__all__ = ("run_planner",)

logger = logging.getLogger(__name__)


async def run_planner(config: PlannerConfig) -> int:
    """Plan until a signal; the exit code (1: no NATS or no discovery, 2: the port)."""
    from operators.planner.planner import Planner
    from pipeline.transports.nats import DEFAULT_NAMESPACE

    try:
        sock = listen(config.host, config.port)
    except CannotListen as exc:
        print(f"llm-pipeline: {exc}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    nc = await connect_nats(config.nats, name="llm-pipeline planner")
    if nc is None:
        sock.close()
        return 1
    metrics = PlannerMetrics()
    connector = LocalConnector(
        config.commands,
        nats=config.nats,
        drain_timeout=config.drain_timeout,
        on_restart=metrics.restarted,
    )
    planner = Planner(
        nc,
        config.pools,
        connector,
        interval=config.interval,
        namespace=DEFAULT_NAMESPACE,
        metrics=metrics,
    )
    app = PlannerApp(metrics, planner.status)
    planning = anyio.CancelScope()
    code = 0

    async def on_signals(signals: AsyncIterator[int], forced: anyio.CancelScope) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not planning.cancel_called:
                logger.info("%s: the planner stops and drains its workers", name)
                planning.cancel()
            else:
                logger.warning("%s: the planner kills its workers", name)
                forced.cancel()

    try:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as tg:
                tg.start_soon(on_signals, signals, tg.cancel_scope)
                async with connector:
                    with planning:
                        async with anyio.create_task_group() as serving:
                            serving.start_soon(serve_http, app, sock, name="planner http")
                            await serving.start(planner.run)
                            pools = ", ".join(f"{p.model!r} ({p.role})" for p in config.pools)
                            shown = f"[{host}]" if ":" in host else host
                            print(
                                f"llm-pipeline planner on http://{shown}:{port} planning "
                                f"{pools} via {config.nats}",
                                flush=True,
                            )
                tg.cancel_scope.cancel()
    except Exception as exc:  # nats-py's errors, a server without JetStream
        print(f"llm-pipeline: the planner cannot plan: {one_line(exc)}", file=sys.stderr)
        code = 1
    finally:
        sock.close()
        await close_nats(nc)
    return code
