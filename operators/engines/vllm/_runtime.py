"""vLLM running under one engine: started, its tasks put on our event loop, and stopped.

vLLM is a server of its own. Starting it (:class:`VllmRuntime`) creates ``AsyncLLM``, the
client in our process, which spawns the engine core (and, on CPUs, a worker under it);
a :class:`~._reaper.ProcessReaper` watches those processes in case ours dies without
stopping them, and a :class:`~._kv_events.KvEventListener` subscribes to the engine core's
KV events on a socket in a folder of its own. Stopping it undoes all of that, in an order
that leaves nothing behind: vLLM's tasks on the event loop first (they would otherwise see
the engine core die under them and log it as a failure), then ``AsyncLLM`` (its engine core
exits by itself), then its ZMQ context, which vLLM leaves to the garbage collector (which
warns), then the reaper, the listener and the socket folder.

The engine (:class:`~.engine.VllmEngine`) holds one and asks it for ``llm`` on every
request: None once stopped.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, final

import anyio

from operators.engines._kv_delivery import KvDelivery
from operators.engines._vllm_kv_events import BlockTranslator, KvEventListener
from pipeline import EngineError

from ._args import engine_args, import_vllm
from ._reaper import ProcessReaper, descendants
from ._sampling import EngineLimits
from ._stats import SchedulerCounts, stat_logger_class

__all__ = ("VllmRuntime",)

logger = logging.getLogger("operators.engines.vllm")


@final
class VllmRuntime:
    """vLLM started for ``model`` with ``options`` (``engine_args``' keywords): its KV events
    translated by ``translator`` into ``kv``, its scheduler statistics kept in ``counts``.

    Creating one blocks until the model is loaded (seconds to a minute); if that fails,
    whatever was started is stopped before the error propagates.

    Raises:
        EngineError: vLLM could not start.
    """

    def __init__(
        self,
        model: str | Path,
        translator: BlockTranslator,
        kv: KvDelivery,
        counts: SchedulerCounts,
        *,
        log_level: str,
        **options: Any,
    ) -> None:
        self._sockets = tempfile.mkdtemp(prefix="llmp-vllm-")
        #: vLLM's ``AsyncLLM`` (None once stopped)
        self.llm: Any = None
        self._listener: KvEventListener | None = None
        self._reaper: ProcessReaper | None = None
        self._tasks_started = False
        self._zmq_context: Any = None
        try:
            import_vllm(log_level)
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM

            endpoint = f"ipc://{self._sockets}/kv-events"
            args = engine_args(
                model, kv_endpoint=endpoint, on_cpu=current_platform.is_cpu(), **options
            )
            before = descendants()
            try:
                # (no local name for it: a frame of this call outlives it, captured by an
                # import below, and would keep it alive until the interpreter exits)
                self.llm = AsyncLLM.from_engine_args(
                    AsyncEngineArgs(**args), stat_loggers=[stat_logger_class(counts)]
                )
            except Exception as exc:
                raise EngineError(f"vLLM could not start: {exc}") from exc
            finally:  # (also when it failed half-way: what it started must not outlive us)
                self._reaper = ProcessReaper(descendants() - before)
            config = self.llm.vllm_config
            model_config = config.model_config
            #: what the model can take (vocabulary, context window, logprobs)
            self.limits = EngineLimits(
                vocab_size=model_config.get_vocab_size(),
                max_model_len=model_config.max_model_len,
                max_logprobs=model_config.max_logprobs,
            )
            #: tokens per block in vLLM's own KV cache
            self.block_size = int(config.cache_config.block_size)
            self._listener = KvEventListener(endpoint, translator, kv)
            self._listener.start()
            try:  # created from a worker thread of an event loop: start vLLM's tasks on it now
                anyio.from_thread.run_sync(self.start_tasks)
            except RuntimeError:  # (not in one: the first request starts them)
                pass
            logger.info(
                "vLLM serves %s (max_model_len=%d, block_size=%d)",
                model,
                self.limits.max_model_len,
                self.block_size,
            )
        except BaseException:  # what was started must not outlive a failed start
            self.close()
            raise

    def start_tasks(self) -> None:
        """Start ``AsyncLLM``'s two tasks on the running event loop (its socket reader and
        its output handler), which it starts by itself only when it is created on that
        loop, or at the first request: then they would appear under that request, as tasks
        a request left behind. Idempotent."""
        llm = self.llm
        if self._tasks_started or llm is None:
            return
        self._tasks_started = True
        ensure_reader = getattr(llm.engine_core, "_ensure_output_queue_task", None)
        if ensure_reader is not None:
            ensure_reader()
        llm._run_output_handler()

    @property
    def processes(self) -> frozenset[int]:
        """The pids of the processes vLLM started (its engine core and workers)."""
        reaper = self._reaper
        return reaper.pids if reaper is not None else frozenset()

    async def aclose(self) -> None:
        """Stop vLLM (its processes included) without blocking the event loop. Idempotent."""
        # vLLM's tasks are stopped first, on their loop: they would otherwise see the engine
        # core die under them (and log that as a failure), and its sockets can be closed.
        tasks = [task for task in _client_tasks(self.llm) if not task.done()]
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            if tasks:
                await asyncio.wait(tasks)
            await anyio.to_thread.run_sync(self.close)
        # vLLM closed its sockets on this loop meanwhile (it was asked from close()'s thread)
        context, self._zmq_context = self._zmq_context, None
        if context is not None:
            _terminate(context)

    def close(self) -> None:
        """Stop vLLM now, blocking until its processes are gone (seconds). Idempotent."""
        llm, self.llm = self.llm, None
        listener, self._listener = self._listener, None
        reaper, self._reaper = self._reaper, None
        try:
            if llm is not None:
                context = getattr(llm.engine_core, "ctx", None)
                loop = _client_loop(llm)
                llm.shutdown(timeout=30)  # (its engine core then exits by itself: no kill)
                del llm
                # vLLM leaves its ZMQ context to the garbage collector, which warns. Its
                # sockets are closed by now, unless their loop runs in another thread: then
                # they are closed on it later, and aclose() terminates the context there.
                if context is not None:
                    if loop is None or loop.is_closed() or _running_loop() is loop:
                        _terminate(context)
                    else:
                        self._zmq_context = context
                # AsyncLLM sits in reference cycles; collected now, its __del__ (a second,
                # harmless shutdown) runs while the interpreter is whole, not at exit.
                gc.collect()
        finally:
            if reaper is not None:
                reaper.stand_down()
            if listener is not None:
                listener.close()
            shutil.rmtree(self._sockets, ignore_errors=True)


def _client_loop(llm: Any) -> asyncio.AbstractEventLoop | None:
    """The event loop ``AsyncLLM``'s tasks run on (None: none started yet)."""
    tasks = _client_tasks(llm)
    return tasks[0].get_loop() if tasks else None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _terminate(context: Any) -> None:
    """Terminate vLLM's ZMQ context: the asyncio one it uses is a shadow of a plain one,
    which alone may terminate (and which warns when collected unterminated)."""
    for socket in list(getattr(context, "_sockets", None) or ()):
        socket.close(linger=0)
    original = getattr(context, "_shadow_obj", None)
    (original if original is not None and hasattr(original, "term") else context).term()


def _client_tasks(llm: Any) -> list[asyncio.Task[Any]]:
    """``AsyncLLM``'s tasks on the event loop: its output handler and its socket reader."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    found = (getattr(llm, "output_handler", None), getattr(resources, "output_queue_task", None))
    return [task for task in found if task is not None]
