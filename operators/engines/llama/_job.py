"""The hand-off between a request's task and the scheduler thread: an outbox and a doorbell.

Why a socket pair per request: the scheduler thread must wake the task that waits for its
outputs without ever blocking on the event loop (a busy loop would stall every sequence in
the batch), and without knowing which event loop that is. Writing one byte to a
non-blocking socket is safe from any thread; the task waits with ``anyio.wait_readable``.
No worker thread is parked per waiting request, and only admitted requests hold a pair.

Ownership: the scheduler appends to the outbox, rings and finally closes the writing end;
the request's task takes from the outbox, waits and closes the reading end. The deque is
the only shared structure (appends and pops are atomic), and each counter has one writer.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any, final

import anyio

from operators.contracts.llm import EngineOutput, PreprocessedRequest

if TYPE_CHECKING:
    from pipeline import Context
    from pipeline.tracing import Span

    from ._constraint import Matcher
    from ._kv_handle import Handle
    from ._lora import Adapter

__all__ = ("Job",)


@final
class Job:
    """One request on its way through the scheduler: what runs, its outbox and doorbell.

    ``width`` is how many slots the request holds (its choices run side by side, at most
    that many at a time). Outputs carry their choice in ``index``; ``None`` in the outbox
    ends the stream, an exception fails it. The scheduler's own bookkeeping of the job's
    choices is not here (``_sequence.Choices``): a job knows nothing of sequences.
    """

    __slots__ = (
        "_outbox",
        "_reader",
        "_writer",
        "adapter",
        "budget",
        "cancelled",
        "consumed",
        "ctx",
        "ended",
        "matchers",
        "n",
        "pull_from",
        "release_transfer",
        "request",
        "resumed",
        "rng_state",
        "timeline",
        "transfer",
        "width",
    )

    def __init__(
        self,
        ctx: Context[PreprocessedRequest],
        *,
        budget: int,
        width: int,
        matchers: list[Matcher] | None = None,
        request: PreprocessedRequest | None = None,
        resumed: bool = False,
        transfer: Handle | None = None,
        rng_state: dict[str, Any] | None = None,
        adapter: Adapter | None = None,
    ) -> None:
        self.ctx = ctx
        #: the adapter (LoRA) its choices run with (None: the base model)
        self.adapter = adapter
        #: what runs: ``ctx.data``, or its continuation after a prefill worker's token
        self.request = ctx.data if request is None else request
        #: 1 when the request continues after a prefill worker's first token (the last
        #: prompt token is that output token), else 0
        self.resumed = int(resumed)
        #: the handle whose cells are pulled before decoding (None: none to pull)
        self.transfer = transfer
        #: the first choice's random state to continue from (a prefill worker's)
        self.rng_state = rng_state
        # set by the scheduler: the first cell to pull (the task pulls, then arrives), or
        # that the transferred cells are not needed (the task releases them)
        self.pull_from: int | None = None
        self.release_transfer = False
        self.budget = budget
        self.n = max(self.request.n, 1)
        self.width = width
        #: one per choice when the request is constrained (each choice advances its own)
        self.matchers = matchers
        # written by the request's task only
        self.cancelled = False
        self.consumed = [0] * self.n
        self.ended = False
        #: a traced request's step timing, appended by the scheduler thread: (event name,
        #: time.time_ns(), attributes); None when the request is not traced
        self.timeline: list[tuple[str, int, dict[str, int]]] | None = (
            None if ctx.span is None else []
        )
        self._outbox: deque[EngineOutput | Exception | None] = deque()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)

    # ----------------------------------------------------------- the request's task side

    def take(self) -> EngineOutput | None:
        """The next output; None when there is none yet, or after the end (``ended``).

        Raises:
            Exception: what the scheduler failed the request with (an ``EngineError``).
        """
        if not self._outbox:
            return None
        item = self._outbox.popleft()
        if item is None or isinstance(item, Exception):
            self.ended = True
            if item is not None:
                raise item
            return None
        self.consumed[item.index] += 1
        return item

    async def wait(self) -> None:
        """Wait until the scheduler rings (an output, the end, or an error is in)."""
        await anyio.wait_readable(self._reader)
        with contextlib.suppress(BlockingIOError):
            self._reader.recv(4096)

    def close(self) -> None:
        """The request's task is done with the job: a job that has not ended is cancelled
        (the scheduler frees its slots at its next step)."""
        if not self.ended:
            self.cancelled = True
        self._reader.close()

    def trace(self, span: Span) -> None:
        """A traced request's step timing, recorded by the scheduler thread, as ``span``'s
        events: each prefill chunk, the end of prefill (per choice), and one ``decode``
        summary."""
        if self.timeline is None:
            return
        prefilled = 0
        for name, time_ns, attributes in list(self.timeline):
            span.add_event(name, attributes, time_ns=time_ns)
            if name == "prefilled" and not prefilled:
                prefilled = time_ns
        if prefilled:
            seconds = (time.time_ns() - prefilled) / 1e9
            span.add_event(
                "decode",
                {
                    "llm_pipeline.outputs": sum(self.consumed),
                    "llm_pipeline.decode_ms": round(seconds * 1e3, 3),
                },
            )

    # ------------------------------------------------------------ the scheduler's side

    def push(self, output: EngineOutput) -> None:
        """Queue ``output``; the request's task sees it after the next :meth:`ring`."""
        self._outbox.append(output)

    def ring(self) -> None:
        """Wake the request's task."""
        self._ring()

    def end(self, error: Exception | None = None) -> None:
        """Deliver the end of the stream (or ``error``) and let go of the doorbell."""
        self._outbox.append(error)
        self._ring()
        self._writer.close()

    def drop(self) -> None:
        """Let go of a cancelled job's doorbell."""
        self._writer.close()

    def _ring(self) -> None:
        # BlockingIOError: the buffer is full, so the reader has bytes to wake on anyway;
        # OSError: the request's task has closed its end.
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")
