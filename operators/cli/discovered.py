"""``serve --nats`` without ``--model-name``: every model that workers register, each
behind a graph of its own (:class:`DiscoveredModels`).

::

    NatsModels (every key of the discovery bucket) --> a new model name
        --> discover_workers(model) --> Router over its decode set --> build_model(name, ...)
        --> app.models: listed while the model has decode workers

A model is listed in ``/v1/models`` (and routed to) from the moment its first aggregated or
decode worker joins until its last one leaves; then a request naming it is a 404, while
requests already routed to it wait ``--worker-wait`` seconds for a worker and end with a
503 if none comes (never a hang). Every discovered model is served with the frontend's
tokenizer, chat template and parsers (the workers serve token ids), like the one model of
``serve --nats --model-name NAME``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, final

import anyio
from anyio.abc import TaskStatus

from operators.serving import build_model

from .model_graph import engine_and_options
from .nats import follow_kv_events

if TYPE_CHECKING:
    from nats.aio.client import Client

    from operators.edges.http.metrics import ServerMetrics
    from operators.edges.http.models import Models
    from operators.text.tokenizer import Tokenizer
    from operators.ui import WorkerGroups
    from pipeline import WorkerSet
    from pipeline.health import Health

    from .config import ServeConfig

__all__ = ("DiscoveredModels",)

logger = logging.getLogger(__name__)


@final
class DiscoveredModels:
    """Keeps ``models`` in step with the models workers register on ``nc`` (an app's, once
    :meth:`attach` ed to it)."""

    def __init__(
        self,
        nc: Client,
        models: Models,
        *,
        config: ServeConfig,
        tokenizer: Tokenizer,
        metrics: ServerMetrics,
        before: Any,
    ) -> None:
        self._nc = nc
        self._models = models
        self._config = config
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._before = before
        #: each model's worker sets by role, for the status view
        self.groups: dict[str, WorkerGroups] = {}
        self._health: Health | None = None
        self._decode: dict[str, WorkerSet[Any, Any]] = {}  # of the models served now

    def attach(self, models: Models, health: Health | None = None) -> None:
        """Follow into ``models`` from now on (what is served now is added to it), telling
        ``health`` each served model's readiness (its ready decode workers)."""
        for model in self._models:
            models.add(model)
            if health is not None:
                health.watch(model.name, self._decode[model.name])
        self._models = models
        self._health = health

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow until cancelled; ``task_status`` is told once the models registered now
        are followed.

        Raises:
            JetStreamUnavailable: the discovery bucket cannot be watched at first.
        """
        from pipeline.transports.nats import NatsModels

        async with anyio.create_task_group() as tg:

            def on_model(name: str) -> None:
                tg.start_soon(self._follow, name, name=f"follow model {name}")

            await tg.start(NatsModels(self._nc).run, on_model)
            task_status.started()

    def _forget(self, name: str) -> None:
        self._models.remove(name)
        self._decode.pop(name, None)
        if self._health is not None:
            self._health.forget(name)

    async def _follow(self, name: str) -> None:
        """Serve ``name`` while it has decode workers, until cancelled."""
        from operators.contracts.remote_embed import RemoteEmbedder
        from operators.contracts.transport import discover_workers

        config = self._config
        try:
            async with (
                discover_workers(self._nc, model=name) as workers,
                anyio.create_task_group() as tg,
            ):
                kv_feeds = None
                if config.router == "kv":
                    kv_feeds = await follow_kv_events(
                        tg, self._nc, model=name, sets=(workers.decode, workers.prefill)
                    )
                engine, options, groups = engine_and_options(
                    config, self._tokenizer, workers, None, self._metrics, kv_feeds
                )
                options["on_migration"] = self._metrics.count_migration
                served = build_model(
                    name,
                    engine,
                    self._tokenizer,
                    before=self._before,
                    embedder=RemoteEmbedder(self._nc, model=name, workers=workers.decode),
                    **options,
                )
                if groups is not None:
                    self.groups[name] = groups
                decode = workers.decode

                def changed(worker_id: str = "", joined: bool = True) -> None:
                    listed = name in self._models
                    if len(decode) and not listed:
                        self._models.add(served)
                        self._decode[name] = decode
                        if self._health is not None:
                            self._health.watch(name, decode)
                        logger.info("serving model %r: its workers registered", name)
                    elif not len(decode) and listed:
                        self._forget(name)
                        logger.info("model %r left /v1/models: no worker of it is ready", name)

                stop = decode.listen(changed)
                try:
                    changed()
                    await anyio.sleep_forever()
                finally:
                    stop()
                    self._forget(name)
        except Exception as exc:  # nats-py's errors: this model is not served
            logger.warning("cannot follow the workers of model %r: %r", name, exc)
