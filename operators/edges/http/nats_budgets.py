"""Every key's budget shared by every frontend, in a NATS JetStream KV bucket:
:class:`NatsBudgets` (``serve --nats`` with ``--api-keys``).

One entry per key (``t.`` and a digest of its name), holding what :mod:`.limits` keeps
(the requests and tokens used, as of when) and each frontend's requests in flight::

    {"r": [used, at], "t": [used, at], "i": {"<frontend>": 3, ...}}

An admission reads the entry, applies :func:`~.limits.admit`, and writes it back only if
nobody wrote it meanwhile (KV ``update`` with the revision read: compare-and-set); a
conflict rereads and applies again. A frontend keeps the entry it last wrote and writes
on top of it without reading (one round trip), until a conflict shows another frontend
writes the key too: then, for a second, it reads before each write, as the others do, so
that the last writer has no head start and no frontend's batches starve. So a key's
limits hold across frontends exactly, as if one process kept them, and a frontend
restarting loses nothing but its own in-flight count (which it rewrites whole on its next
write). Why not leases (each frontend holding
a share of the budget and asking for more): a lease either splits a key's minute into
slices that idle on one frontend while another refuses, or needs the same round trip to
rebalance; compare-and-set costs one round trip per operation and is exact.

The round trips are batched: a frontend's operations on one key wait while one write of
that key is in flight, then go together in the next (group commit), so a busy key costs
one round trip per batch, not per request (``benchmarks/bench_admission.py --nats``).

Frontends see each other through one more entry (``frontends``: each one's last
heartbeat, every :data:`HEARTBEAT` seconds; one not heard for three is gone). When the
bucket cannot be reached (the connection down, an operation timing out), a frontend
falls back to :class:`~.budgets.LocalBudgets` with its share of every limit (the limit
over the frontends it last saw), and says so once in its log; it says so again when the
bucket is back. The bucket is on the NATS server's disk, as the Responses store's: a
restart of it keeps who used what.

Needs the ``nats`` extra; loaded only by ``serve --nats``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import nats.errors
import nats.js.errors
import orjson
from anyio.abc import TaskStatus
from nats.js.api import KeyValueConfig, StorageType

from .budgets import LocalBudgets
from .limits import Ask, Budget, Meter, Verdict, admit, release

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.kv import KeyValue

    from .tenants import Tenant

__all__ = ("DEFAULT_BUCKET", "HEARTBEAT", "NatsBudgets")

logger = logging.getLogger(__name__)

#: the bucket every frontend keeps the keys' budgets in
DEFAULT_BUCKET: Final = "llm_pipeline_limits"
#: seconds between a frontend's heartbeats (three missed: it is gone)
HEARTBEAT: Final = 2.0
#: seconds one batch of operations may take before the frontend falls back to its share
OPERATION_TIMEOUT: Final = 1.0
#: compare-and-set attempts of one batch before it falls back (a key under a storm of
#: writes from many frontends)
_ATTEMPTS: Final = 32
#: seconds a key stays contended after a conflict: its writes read first, as everyone's do
_CONTENDED: Final = 1.0
#: how long an entry nobody writes is kept (a key idle that long is full again anyway)
_ENTRY_TTL: Final = 24 * 3600.0
_FRONTENDS: Final = "frontends"
_ADMITTED: Final = Verdict(True)


@dataclass(slots=True)
class _Operation:
    """One take or give waiting for its batch."""

    tenant: Tenant
    ask: Ask
    take: bool
    #: set when it is done, or when its turn came to write the next batch
    turn: anyio.Event = field(default_factory=anyio.Event)
    done: bool = False
    verdict: Verdict = field(default_factory=lambda: _ADMITTED)

    def finish(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.done = True
        self.turn.set()


@final
class NatsBudgets:
    """A :class:`~.budgets.Budgets` in the JetStream KV bucket ``kv``, shared with every
    frontend using it (this one is ``frontend``); make one with :meth:`open` and run
    :meth:`run` beside it (the heartbeat)."""

    def __init__(
        self,
        nc: Client,
        kv: KeyValue,
        *,
        bucket: str = DEFAULT_BUCKET,
        frontend: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nc = nc
        self._kv = kv
        self.bucket = bucket
        #: this frontend's name among the others
        self.frontend = frontend or uuid.uuid4().hex[:12]
        self._clock = clock
        self._pending: dict[str, list[_Operation]] = {}
        self._flushing: set[str] = set()
        #: entry key -> (revision, state) as this frontend last read or wrote it
        self._cache: dict[str, tuple[int, dict[str, Any]]] = {}
        #: entry key -> until when (monotonic) it is contended
        self._contended: dict[str, float] = {}
        #: this frontend's requests in flight, by key name
        self._inflight: dict[str, int] = {}
        #: the frontends heard from lately (this one included)
        self.frontends: frozenset[str] = frozenset({self.frontend})
        self._fallback = LocalBudgets(clock)
        self._degraded = False

    @classmethod
    async def open(
        cls, nc: Client, *, bucket: str = DEFAULT_BUCKET, frontend: str | None = None
    ) -> NatsBudgets:
        """The budgets in ``bucket`` (created when missing).

        Raises:
            nats.errors.Error: JetStream cannot be reached or refuses the bucket.
        """
        js = nc.jetstream()
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = KeyValueConfig(
                bucket=bucket, history=1, ttl=_ENTRY_TTL, storage=StorageType.FILE
            )
            try:
                kv = await js.create_key_value(config)
            except nats.js.errors.APIError:
                kv = await js.key_value(bucket)  # another frontend created it first
        return cls(nc, kv, bucket=bucket, frontend=frontend)

    # --------------------------------------------------------------- the Budgets protocol

    async def take(self, tenant: Tenant, ask: Ask, /) -> Verdict:
        """Take ``ask`` from the key's shared budget if its limits allow it."""
        operation = _Operation(tenant, ask, take=True)
        await self._submit(operation)
        return operation.verdict

    async def give(self, tenant: Tenant, back: Ask, /) -> None:
        """Give ``back`` to the key's shared budget."""
        await self._submit(_Operation(tenant, back, take=False))

    # -------------------------------------------------------------------------- batches

    async def _submit(self, operation: _Operation) -> None:
        """Run ``operation`` in its key's next batch. The operations that come while a
        write of the key is in flight wait; when it lands, the first of them writes them
        all, as one batch, and hands the next batch to the first that came meanwhile (so
        no caller writes others' batches for long). Shielded (a batch is bounded by
        :data:`OPERATION_TIMEOUT`): an operation a caller gave up on is applied anyway,
        and so accounted for."""
        name = operation.tenant.name
        self._pending.setdefault(name, []).append(operation)
        with anyio.CancelScope(shield=True):
            if name in self._flushing:
                await operation.turn.wait()  # done, or its turn to write the next batch
                if operation.done:
                    return
            self._flushing.add(name)
            try:
                await self._apply(self._pending.pop(name))
            finally:
                waiting = self._pending.get(name)
                if waiting:
                    waiting[0].turn.set()  # the next batch's writer
                else:
                    self._flushing.discard(name)

    async def _apply(self, batch: list[_Operation]) -> None:
        tenant = batch[-1].tenant  # (the latest terms: a reload may have changed them)
        if not self._nc.is_connected:
            self._fall_back(batch, "the NATS connection is down")
            return
        key = "t." + hashlib.sha256(tenant.name.encode()).hexdigest()[:40]
        try:
            with anyio.fail_after(OPERATION_TIMEOUT):
                for _ in range(_ATTEMPTS):
                    if self._contended.get(key, 0.0) > time.monotonic():
                        self._cache.pop(key, None)
                    revision, state = await self._read(key)
                    mine, verdicts, state = self._applied(tenant, state, batch)
                    try:
                        revision = await self._write(key, state, revision)
                    except nats.js.errors.KeyWrongLastSequenceError:
                        # Another frontend wrote: read again. While a key is contended its
                        # writers all read first, so the one that wrote last has no head
                        # start (with its revision cached it would win every race).
                        self._cache.pop(key, None)
                        self._contended[key] = time.monotonic() + _CONTENDED
                        await anyio.sleep(random.uniform(0, 0.001))
                        continue
                    self._cache[key] = (revision, state)
                    break
                else:
                    raise TimeoutError(f"{_ATTEMPTS} writers raced for it")
        except Exception as exc:  # nats-py's errors, a timeout, an entry not of ours
            self._cache.pop(key, None)
            self._fall_back(batch, str(exc) or type(exc).__name__)
            return
        self._recovered()
        self._inflight[tenant.name] = mine
        for operation, verdict in zip(batch, verdicts, strict=True):
            operation.finish(verdict)

    def _applied(
        self, tenant: Tenant, state: dict[str, Any], batch: list[_Operation]
    ) -> tuple[int, list[Verdict], dict[str, Any]]:
        """(this frontend's requests in flight, each operation's verdict, the state) after
        ``batch`` is applied to ``state``."""
        now = self._clock()
        limits = tenant.limits
        counts: dict[str, int] = {
            frontend: n
            for frontend, n in state.get("i", {}).items()
            if frontend in self.frontends and frontend != self.frontend and n > 0
        }
        mine = self._inflight.get(tenant.name, 0)
        budget = Budget(
            Meter(*state.get("r", (0.0, 0.0))),
            Meter(*state.get("t", (0.0, 0.0))),
            sum(counts.values()) + mine,
        )
        verdicts = []
        for operation in batch:
            if operation.take:
                budget, verdict = admit(budget, limits, operation.ask, now)
                if verdict.admitted:
                    mine += operation.ask.inflight
            else:
                budget = release(budget, limits, operation.ask, now)
                mine = max(0, mine - operation.ask.inflight)
                verdict = _ADMITTED
            verdicts.append(verdict)
        if mine:
            counts[self.frontend] = mine
        written = {
            "r": [budget.requests.used, budget.requests.at],
            "t": [budget.tokens.used, budget.tokens.at],
            "i": counts,
        }
        return mine, verdicts, written

    async def _read(self, key: str) -> tuple[int, dict[str, Any]]:
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return 0, {}
        state = orjson.loads(entry.value) if entry.value else {}
        return entry.revision or 0, state if isinstance(state, dict) else {}

    async def _write(self, key: str, state: dict[str, Any], revision: int) -> int:
        value = orjson.dumps(state)
        if revision:
            return await self._kv.update(key, value, last=revision)
        try:
            return await self._kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise
        except nats.js.errors.APIError as exc:  # created meanwhile: a conflict like any
            raise nats.js.errors.KeyWrongLastSequenceError(description=str(exc)) from exc

    # --------------------------------------------------------------------- the fallback

    def _fall_back(self, batch: list[_Operation], why: str) -> None:
        """Apply ``batch`` to this frontend's share of the limits."""
        parts = len(self.frontends)
        if not self._degraded:
            self._degraded = True
            logger.warning(
                "shared limits: the NATS bucket %r cannot be reached (%s): this frontend "
                "enforces 1/%d of every key's limits (%d frontends seen) until it can",
                self.bucket,
                why,
                parts,
                parts,
            )
        for operation in batch:
            tenant = operation.tenant
            share = dataclasses.replace(tenant, limits=tenant.limits.share(parts))
            name = tenant.name
            if operation.take:
                verdict = self._fallback.take_now(share, operation.ask)
                if verdict.admitted:
                    self._inflight[name] = self._inflight.get(name, 0) + operation.ask.inflight
            else:
                verdict = _ADMITTED
                self._fallback.give_now(share, operation.ask)
                self._inflight[name] = max(0, self._inflight.get(name, 0) - operation.ask.inflight)
            operation.finish(verdict)

    def _recovered(self) -> None:
        if self._degraded:
            self._degraded = False
            logger.warning(
                "shared limits: the NATS bucket %r is back: limits are shared again", self.bucket
            )

    # ------------------------------------------------------------------------ heartbeat

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Tell the other frontends this one is here, and learn who they are, every
        :data:`HEARTBEAT` seconds until cancelled (the first time before ``task_status``
        is told)."""
        await self.beat()
        task_status.started()
        while True:
            await anyio.sleep(HEARTBEAT)
            await self.beat()

    async def beat(self) -> None:
        """One heartbeat: this frontend's time in the ``frontends`` entry, the ones not
        heard from for three heartbeats dropped (a failure waits for the next one)."""
        if not self._nc.is_connected:
            return
        try:
            with anyio.fail_after(OPERATION_TIMEOUT):
                for _ in range(_ATTEMPTS):
                    revision, state = await self._read(_FRONTENDS)
                    now = self._clock()
                    seen = {
                        frontend: when
                        for frontend, when in state.items()
                        if isinstance(when, int | float) and now - when < 3 * HEARTBEAT
                    }
                    seen[self.frontend] = now
                    try:
                        revision = await self._write(_FRONTENDS, seen, revision)
                    except nats.js.errors.KeyWrongLastSequenceError:
                        self._cache.pop(_FRONTENDS, None)
                        continue
                    self._cache.pop(_FRONTENDS, None)  # (read fresh each time: others write)
                    self.frontends = frozenset(seen)
                    return
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            logger.debug("shared limits: a heartbeat failed: %r", exc)

    def __repr__(self) -> str:
        return f"NatsBudgets({self.bucket!r}, frontend={self.frontend!r})"
