"""``llm-pipeline worker``: one raw engine served over NATS for a model and role, until
SIGINT/SIGTERM, then a drain.

The worker serves EngineOutput, never the Backend: the stateful operators stay on the
frontend, so nothing of a request's state has to cross the wire. An engine that reports
its prefix cache (``--engine mocker --mocker-cache-blocks N``, the llama engine) also
publishes its KV events for ``serve --nats --router kv`` frontends. Every worker publishes
its load when it changes (requests waiting and decoding, prompt tokens queued), for
``llm-pipeline planner``, and drains when a planner tells it to, as on SIGTERM.

The worker watches its own engine (:mod:`pipeline.health`, the ``--stall-timeout``,
``--canary-interval`` and ``--engine-restarts`` options): until its engine first answers
a one-token probe (a worker a planner just started is routed to once it works, not once
it loaded), while it is stalled, failing its canary or being rebuilt, its registration
says it is not ready and frontends route around it (its in-flight streams fail over with
``EngineStalled`` or ``EngineDead``, so they migrate); an engine dead beyond recovery
deregisters the worker, which drains and exits with code 1 after one log line naming why.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio

from operators.contracts.constraint_guard import guarded
from operators.contracts.llm import embedder_of
from operators.telemetry import make_tracer, tracing_options
from operators.text.tokenizer import Tokenizer
from pipeline import link
from pipeline.health import Health

from .config import WorkerConfig
from .defaults import MODEL_ENGINES
from .engines import load_engine, load_llama, make_engine
from .health import supervise
from .nats import close_nats, connect_nats, one_line, publish_kv_events, publish_load
from .observability import WORKER_SERVICE_NAME

if TYPE_CHECKING:
    from nats.aio.client import Client

    from pipeline.transports.nats import NatsWorker

__all__ = ("run_worker",)

logger = logging.getLogger(__name__)


async def _worker_engine(config: WorkerConfig, tokenizer: Tokenizer | None) -> Any:
    """The engine a ``worker`` serves."""
    if config.engine.engine == "llama":
        return await load_llama(config.engine, config.role, config.id)
    if config.engine.engine in MODEL_ENGINES:
        return await load_engine(config.engine, log_level=config.log_level)
    if config.engine.engine == "remote":  # one upstream server, fronted as it is
        from operators.engines.remote import RemoteEngine, parse_upstream

        [upstream] = config.engine.upstream
        return await RemoteEngine.connect(
            parse_upstream(upstream, config.engine.upstream_kind),
            tokenizer=tokenizer,
            block_size=config.engine.kv_block_size,
            stall_timeout=config.engine.upstream_timeout,
        )
    assert tokenizer is not None
    return make_engine(config.engine, tokenizer, config.role, config.id)


async def run_worker(config: WorkerConfig, tokenizer: Tokenizer | None) -> int:
    """Serve until a signal, then drain; the exit code (1: no engine, no NATS, no serving).

    A first signal deregisters the worker and lets its in-flight streams finish (up to
    ``config.drain_timeout``); a second one, or a signal before it serves, cancels.
    """
    from operators.contracts.remote_embed import serve_embeddings
    from operators.contracts.transport import RequestLog, coalesce_outputs, llm_codec
    from pipeline.transports.nats import NatsTimeouts
    from pipeline.transports.nats import serve as serve_engine

    worker_id = config.id
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
                    config.drain_timeout,
                )
                worker.stop()
            else:
                what = "cuts the drain short" if stopping else "stops before serving"
                logger.warning("%s: worker %s %s", name, worker_id, what)
                scope.cancel()

    engine: Any = None
    health = Health()
    nc: Client | None = None
    tracing = tracing_options(config.otlp_traces_endpoint, service_name=WORKER_SERVICE_NAME)
    tracer, exporter = make_tracer(
        tracing,
        resource={"service.instance.id": worker_id, "llm_pipeline.worker.role": config.role},
    )
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(on_signals, signals)
            try:
                with scope:
                    try:
                        engine = await _worker_engine(config, tokenizer)
                    except Exception as exc:  # a missing model file, llama.cpp failing
                        print(f"llm-pipeline: cannot load the engine: {exc}", file=sys.stderr)
                        return 1
                    # (an upstream's model unless --model-name says)
                    model = config.model_name or engine.info.display_model
                    rebuilt = config.engine.engine in MODEL_ENGINES  # (echo, mocker: no need)
                    factory = functools.partial(_worker_engine, config, tokenizer)
                    engine = supervise(
                        engine,
                        config,
                        name=worker_id,
                        factory=factory if rebuilt else None,
                        first_probe=True,  # (routed to once it answers, not once it loaded)
                    )
                    health.watch(model, engine)
                    nc = await connect_nats(config.nats, name=f"llm-pipeline worker {worker_id}")
                    if nc is None:
                        return 1
                    log = RequestLog(worker_id)
                    served = serve_engine(
                        link(log, guarded(engine)),
                        nc=nc,
                        model=model,
                        role=config.role,
                        worker_id=worker_id,
                        codec=llm_codec(),
                        timeouts=NatsTimeouts(drain=config.drain_timeout),
                        tracer=tracer,
                        coalesce=coalesce_outputs,
                    )
                    engine.on_change(
                        lambda watched: served.set_ready(watched.ready, watched.reason)
                    )
                    served.set_ready(engine.ready, engine.reason)  # (registers not ready)

                    async def stop_when_dead() -> None:
                        nonlocal code, stopping
                        why = await health.wait_dead()
                        logger.error(
                            "worker %s: its engine is dead beyond recovery, exiting after the "
                            "drain: %s",
                            worker_id,
                            why,
                        )
                        code = 1
                        if worker is not None and not stopping:
                            stopping = True
                            worker.stop()
                        elif worker is None:
                            scope.cancel()

                    await tg.start(health.run)
                    tg.start_soon(stop_when_dead)
                    try:
                        await publish_kv_events(tg, nc, engine, model=model, worker_id=worker_id)
                        await publish_load(tg, nc, log, engine, model=model, worker_id=worker_id)
                        if embedder_of(engine) is not None:
                            await serve_embeddings(nc, engine, model=model)
                        async with served:
                            worker = served
                            print(
                                f"llm-pipeline worker {worker_id} serving model "
                                f"{model!r} as {config.role} via {config.nats}",
                                flush=True,
                            )
                            await served.serve_forever()
                    except Exception as exc:  # nats-py's errors, a server without JetStream
                        print(
                            f"llm-pipeline: worker {worker_id} cannot serve: {one_line(exc)}",
                            file=sys.stderr,
                        )
                        code = 1
            finally:
                tg.cancel_scope.cancel()
                if nc is not None:
                    await close_nats(nc)
                aclose = getattr(engine, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
                if exporter is not None:
                    exporter.shutdown()  # what the drained requests recorded goes out
    return code
