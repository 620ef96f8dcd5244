"""The upstream servers of one model, as the members of one WorkerSet.

``--upstream`` given several times puts several servers behind the same
:class:`~pipeline.Router` that in-process workers and NATS workers use, so a request's
retry after a lost server (Migration) goes to another one, routed by the same policies.
:func:`open_upstreams` connects to them all at once (each :class:`RemoteEngine` asks its
server what it is), then watches each one every ``poll_interval`` seconds, in a task of
its own:

- its load (:meth:`RemoteEngine.poll`): the routers' reported load;
- its health: a server that does not answer the poll, or that a request lost, leaves the
  worker set at once (new requests and retries go elsewhere; its running streams are
  already lost), and comes back in when it answers again. A server down at start is
  connected to when it comes up.

The watchers run in a task group the context manager holds open, so they end with it, and
the engines' HTTP clients and KV event listeners are closed after them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, final

import anyio
import httpx

from operators.engines._prefix_cache import DEFAULT_BLOCK_SIZE
from operators.engines._vllm_kv_events import import_zmq
from pipeline import WorkerSet

from ._spec import Upstream
from .engine import STALL_TIMEOUT, RemoteEngine

if TYPE_CHECKING:
    from operators.contracts.llm import EngineOutput, PreprocessedRequest
    from operators.text.tokenizer import Tokenizer

__all__ = ("DEFAULT_POLL_INTERVAL", "UpstreamFleet", "open_upstreams")

logger = logging.getLogger("operators.engines.remote")

#: seconds between two reads of an upstream's load (``--upstream-poll-ms``' default)
DEFAULT_POLL_INTERVAL = 0.5


@final
class UpstreamFleet:
    """The upstreams of one model: their engines (those connected so far) and their
    WorkerSet (those up now). Made by :func:`open_upstreams`."""

    def __init__(self, workers: WorkerSet[PreprocessedRequest, EngineOutput]) -> None:
        #: the servers up now, by :attr:`RemoteEngine.name`
        self.workers = workers
        #: every server connected to so far, up or down, in ``--upstream`` order
        self.engines: list[RemoteEngine] = []

    @property
    def model(self) -> str:
        """The model the first connected server serves, as a client would name it."""
        return self.engines[0].info.display_model

    def lost(self, engine: RemoteEngine) -> None:
        """A request lost ``engine``'s server: it leaves the worker set until it answers."""
        if engine.name in self.workers:
            logger.warning("upstream %s lost a request: out until it answers", engine.where)
            self.workers.remove(engine.name)

    def _join(self, engine: RemoteEngine) -> None:
        if engine not in self.engines:
            self.engines.append(engine)
        if engine.name not in self.workers:
            self.workers.add(engine.name, engine)

    async def _watch(
        self, upstream: Upstream, engine: RemoteEngine | None, interval: float, **options: Any
    ) -> None:
        """Poll ``upstream`` forever: connect to it when it first answers, then read its
        load, taking it out of the worker set and back as it stops and starts answering."""
        while True:
            if engine is None:
                try:
                    engine = await RemoteEngine.connect(upstream, on_lost=self.lost, **options)
                except (httpx.HTTPError, ValueError) as exc:
                    logger.debug("upstream %s: not there yet (%s)", upstream.url, exc)
                else:
                    logger.warning("upstream %s answers: in", engine.where)
                    self._join(engine)
            else:
                try:
                    await engine.poll()
                except (httpx.HTTPError, ValueError) as exc:
                    if engine.name in self.workers:
                        logger.warning("upstream %s does not answer (%s): out", engine.where, exc)
                        self.workers.remove(engine.name)
                else:
                    if engine.name not in self.workers:
                        logger.warning("upstream %s answers again: in", engine.where)
                        self._join(engine)
            await anyio.sleep(interval)


@asynccontextmanager
async def open_upstreams(
    upstreams: Sequence[Upstream],
    *,
    tokenizer: Tokenizer | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    stall_timeout: float = STALL_TIMEOUT,
    role: str = "aggregated",
    connect_timeout: float = 10.0,
) -> AsyncIterator[UpstreamFleet]:
    """Connect to ``upstreams`` and watch them while the context is open.

    Those that answer within ``connect_timeout`` seconds are members at once; the others
    join when they answer. Names (``host:port``) must differ. ``stall_timeout``: the longest
    silence of a stream before its server counts as lost (:class:`RemoteEngine`).

    Raises:
        ConnectionError: none answered.
        ValueError: two upstreams have one name, or one is neither vLLM nor llama-server.
        ImportError: a ``kv=`` endpoint, without pyzmq and msgspec.
    """
    names = [upstream.name for upstream in upstreams]
    if len(set(names)) != len(names):
        raise ValueError(f"an upstream is given twice: {', '.join(names)}")
    if not upstreams:
        raise ValueError("no upstream to serve")
    if any(upstream.kv_events is not None for upstream in upstreams):
        import_zmq()  # now, not when a server down at start comes up
    fleet = UpstreamFleet(WorkerSet(role))
    options: dict[str, Any] = {
        "tokenizer": tokenizer,
        "block_size": block_size,
        "stall_timeout": stall_timeout,
    }
    found: list[RemoteEngine | None] = [None] * len(upstreams)
    failures: list[str] = []
    wrong: list[Exception] = []  # not a server that is down: a configuration to fix

    async def connect(i: int, upstream: Upstream) -> None:
        with anyio.move_on_after(connect_timeout):
            try:
                found[i] = await RemoteEngine.connect(upstream, on_lost=fleet.lost, **options)
            except httpx.HTTPError as exc:
                failures.append(f"{upstream.url}: {type(exc).__name__}: {exc}")
            except (ValueError, ImportError) as exc:
                wrong.append(exc)
            return
        failures.append(f"{upstream.url}: no answer within {connect_timeout:g}s")

    try:
        async with anyio.create_task_group() as tg:
            for i, upstream in enumerate(upstreams):
                tg.start_soon(connect, i, upstream)
        if wrong:
            raise wrong[0]
        for engine in found:
            if engine is not None:
                fleet._join(engine)
        if not fleet.engines:
            raise ConnectionError(f"no upstream answered: {'; '.join(failures)}")
        for failure in failures:
            logger.warning("upstream %s (joins when it answers)", failure)
        async with anyio.create_task_group() as tg:
            for upstream, engine in zip(upstreams, found, strict=True):
                watch = functools.partial(fleet._watch, **options)
                tg.start_soon(watch, upstream, engine, poll_interval)
            try:
                yield fleet
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for engine in {id(e): e for e in [*found, *fleet.engines] if e is not None}.values():
                await engine.aclose()
