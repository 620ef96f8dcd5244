"""The llama engine's part in disaggregated serving: a prefill worker issues handles and
serves their cells; a decode worker verifies a handle, pulls what it lacks, and continues.

::

    PrefillRouter --leg (max_tokens=1)--> prefill engine: prompt prefilled, first token out
                                          cells exported into the TransferStore
                  <-- first token + handle (address, transfer id, rng state, signature)
    PrefillRouter --request + handle--> decode engine: handle verified (else EngineError)
                                        the continuation (prompt + first token) is placed
                                        cells [held, prompt) pulled from the prefill worker
                                        loaded into the slot; the first token is decoded

The decode side runs the request as Migration would continue it after one token (the
prompt extended by the first token, ``max_tokens``/``min_tokens`` one less, the token
replayed into the penalties, the constraint and the drafter) with the prefill worker's
random state, so its output is exactly the aggregated one. When the cells cannot be had
(the prefill worker died, the handle expired, another model's cells) the prompt is
prefilled here instead: the client sees the same tokens, later.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final, final

import anyio

from operators.contracts.llm import PreprocessedRequest
from operators.contracts.resumption import continuation
from operators.engines._transfer_handle import PROCESS_SECRET
from pipeline import EngineError

from ._kv_handle import Handle, expired, handle_problem, issue
from ._transfer import TransferError, TransferServer, TransferStore, pull, release
from .options import DEFAULT_TRANSFER_TIMEOUT, Role

if TYPE_CHECKING:
    from pipeline import Context

    from ._job import Job
    from ._kv_cells import KvCells, KvLayout
    from ._runtime import Runtime
    from ._sequence import Sequence

__all__ = ("Disaggregation",)

logger = logging.getLogger("operators.engines.llama")

#: seconds a prefill worker keeps cells nobody pulled
DEFAULT_TRANSFER_TTL: Final = 30.0
#: bytes of cells a prefill worker keeps at most (the oldest go first)
DEFAULT_TRANSFER_BYTES: Final = 1 << 30


@final
class Disaggregation:
    """The transfer side of one llama engine in ``role`` (checked by
    :class:`~.options.LlamaOptions`, as the timeout is)."""

    def __init__(
        self,
        role: Role,
        *,
        worker_id: str,
        secret: bytes | None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        ttl: float = DEFAULT_TRANSFER_TTL,
        capacity_bytes: int = DEFAULT_TRANSFER_BYTES,
    ) -> None:
        self.role: Role = role
        self.worker_id = worker_id
        self.timeout = timeout
        self._secret = PROCESS_SECRET if secret is None else secret
        self._host, self._port = host, port
        self._ttl, self._capacity = ttl, capacity_bytes
        self.store: TransferStore | None = None
        self.server: TransferServer | None = None
        #: seconds spent pulling cells (written by request tasks, on one event loop)
        self.pull_seconds = 0.0
        self._layout: KvLayout | None = None

    def start(self, layout: KvLayout | None) -> None:
        """Begin: ``layout`` is this model's cells' (None: they cannot move, so a prefill
        worker issues handles nobody can pull, and a decode worker always prefills)."""
        self._layout = layout
        if self.role == "prefill" and layout is not None:
            self.store = TransferStore(self._capacity, self._ttl)
            self.server = TransferServer(self.store, self._secret, self._host, self._port)

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()

    # ------------------------------------------------------------------ prefill side

    def issuer(self, runtime: Runtime) -> Any:
        """The scheduler's :data:`~._scheduler.Issuer`, or None for other roles."""
        if self.role != "prefill":
            return None

        def issue_handle(job: Job, seq: Sequence, first_token: int) -> dict[str, Any]:
            store, server, layout = self.store, self.server, self._layout
            transfer_id, expires, address = "", 0.0, ""
            if store is not None and server is not None and seq.slot is not None:
                try:
                    transfer_id, expires = store.put(runtime.export(seq.slot))
                    address = server.address
                except Exception as exc:  # the decode worker will prefill instead
                    logger.warning("KV cells of %s not kept for transfer: %r", job.ctx.id, exc)
            return issue(
                self._secret,
                worker_id=self.worker_id,
                request_id=job.ctx.id,
                token_ids=job.request.token_ids,
                first_token=first_token,
                address=address,
                transfer_id=transfer_id,
                expires=expires,
                layout="" if layout is None else layout.fingerprint,
                rng=seq.rng_state(),
            )

        return issue_handle

    # ------------------------------------------------------------------- decode side

    def continuation(
        self, ctx: Context[PreprocessedRequest]
    ) -> tuple[PreprocessedRequest, Handle | None]:
        """What runs for ``ctx``: its request, or after a handle its continuation.

        Raises:
            EngineError: ``prefill_result`` is not a handle a prefill worker of this
                deployment issued for this request, or ``n`` is above 1.
        """
        request = ctx.data
        if request.prefill_result is None or self.role == "prefill":
            return request, None
        handle, problem = handle_problem(self._secret, ctx.id, request)
        if handle is None:
            raise EngineError(
                f"llama worker {self.worker_id!r}: invalid transfer handle in "
                f"prefill_result: {problem}; a decode request must carry the prefill_result "
                "a prefill worker returned for it",
                request_id=ctx.id,
            )
        if request.n > 1:
            raise EngineError(
                "a transfer handle continues one choice: n must be 1", request_id=ctx.id
            )
        return continuation(request, [handle.first_token]), handle

    def pullable(self, handle: Handle) -> bool:
        """Whether ``handle``'s cells can be pulled (else the prompt is prefilled here)."""
        layout = self._layout
        if layout is None or not handle.transfer_id or handle.layout != layout.fingerprint:
            logger.info("KV cells of transfer %s cannot be used here", handle.transfer_id)
            return False
        if expired(handle):
            logger.info("KV transfer %s expired before it was pulled", handle.transfer_id)
            return False
        return True

    async def pull(self, handle: Handle, start: int) -> KvCells | None:
        """The cells of ``handle`` from position ``start`` on; None (logged) if they cannot
        be had within the timeout."""
        assert self._layout is not None
        started = time.perf_counter()
        try:
            cells = await pull(
                handle.address,
                handle.transfer_id,
                start,
                secret=self._secret,
                layout=self._layout,
                within=self.timeout,
            )
        except TransferError as exc:
            logger.warning("KV transfer %s failed, prefilling instead: %s", handle.transfer_id, exc)
            return None
        seconds = time.perf_counter() - started
        self.pull_seconds += seconds
        logger.info(
            "KV transfer %s: %d cells (%d bytes) pulled from %s in %.1f ms",
            handle.transfer_id,
            cells.count,
            cells.nbytes,
            handle.address,
            seconds * 1000,
        )
        return cells

    async def release(self, handle: Handle) -> None:
        """Tell the prefill worker its cells are not needed (best effort, bounded)."""
        if handle.transfer_id and handle.address:
            with anyio.CancelScope(shield=True):
                await release(
                    handle.address,
                    handle.transfer_id,
                    secret=self._secret,
                    within=min(self.timeout, 2.0),
                )
