"""Admission: whether a request may run now, on its key's terms and the server's, decided
before any work, the same way for every API edge: :class:`Admission`.

::

    enter(call)  the key's limits (:attr:`Guard.budgets <.guard.Guard.budgets>`): a request,
                 the tokens known so far (the output limit it asked for), a slot of the
                 key's max_inflight                             -> 429 in the edge's words
                 a generation: one of max_inflight's slots, or a wait for one in the
                 fair queue (:mod:`.fair_queue`) while fewer than max_queued wait,
                 ending at the request's deadline               -> 503 / 529, 504, 499
    reserve()    the prompt's tokens are known (the graph's first event, before the engine
                 has done anything): the estimate held since its arrival (its body's
                 bytes for its prompt) becomes the prompt and what it may generate (its
                 output limit, or the context's room)           -> 429
    settle()     it ended: its tokens as its usage says them; a reservation's unused
                 part goes back (no usage: the reservation stays spent), the slots are
                 freed, and its key's usage counted (:mod:`.usage`, the metrics)

A :class:`Ticket` is one admitted request. Generation requests take a slot of
``max_inflight`` (:mod:`.generation` calls :meth:`Admission.enter` and the ticket);
``/v1/embeddings``, ``/tokenize``, ``/detokenize`` and ``count_tokens`` are *metered*
routes the app admits the same way without a slot (requests, and for embeddings their
input tokens: :meth:`Ticket.charge`). What counts against ``tokens_per_minute``: the
prompt and output tokens of chat completions, completions, Responses and Messages, and
the input tokens of embeddings; tokenizing and counting tokens count as requests only.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Final, final

import anyio

from .budgets import LocalBudgets
from .failures import ClientGone, Refusal, at_capacity, rate_limited, shut_down, timed_out
from .fair_queue import FairQueue
from .limits import Ask, Rates, Verdict
from .reservation import DEFAULT_COST, needed

if TYPE_CHECKING:
    from .asgi import Receive
    from .guard import Guard
    from .ledger import UsageLedger
    from .metrics import ServerMetrics
    from .tenants import Tenant

__all__ = ("Admission", "Ticket")

#: seconds a settlement (a shared store's round trip) may take after the response
_SETTLE_TIMEOUT: Final = 5.0


@final
class _Turn:
    """A request waiting for a slot."""

    __slots__ = ("admitted", "closed", "event", "evicted", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False
        self.evicted = False
        self.closed = False
        self.admitted = 0


@final
class Ticket:
    """One admitted request: what it holds of its key's budget and of the server's slots,
    given back by :meth:`settle` (once)."""

    __slots__ = (
        "_admission",
        "_limited",
        "_settled",
        "_slot",
        "admission",
        "arrival",
        "model",
        "prompt",
        "rates",
        "reserved",
        "tenant",
    )

    def __init__(
        self,
        admission: Admission,
        tenant: Tenant,
        model: str,
        *,
        reserved: int,
        slot: bool,
        rates: Rates | None,
        arrival: int,
        order: int,
    ) -> None:
        self._admission = admission
        self.tenant = tenant
        #: the model it runs on (its usage's label)
        self.model = model
        #: tokens held in the key's budget
        self.reserved = reserved
        #: its prompt's tokens, once known
        self.prompt: int | None = None
        #: the key's limits as its response tells them (None: the key has none)
        self.rates = rates
        #: this frontend's numbering of admission events: when it arrived, when admitted
        self.arrival = arrival
        self.admission = order
        self._slot = slot
        self._limited = tenant.limits.any
        self._settled = False

    async def reserve(self, prompt: int, request: Any, context: int | None) -> None:
        """The prompt is known (``prompt`` tokens, of the graph ``request``, on a model of
        ``context`` tokens): hold exactly the prompt and what the request may generate
        (:func:`~.reservation.needed`) instead of the estimate held since its arrival.

        Raises:
            Refusal: 429, the key's tokens per minute do not hold that now (or ever).
        """
        self.prompt = prompt
        tpm = self.tenant.limits.tokens_per_minute
        if tpm is None:
            return
        total = needed(request, prompt, context, tpm)
        if total >= self.reserved:
            await self._take(total - self.reserved, total)
            return
        back = self.reserved - total  # (the estimate was more than it needs)
        self.reserved = total
        await self._admission.give(self.tenant, Ask(tokens=back))

    async def charge(self, tokens: int) -> None:
        """Count ``tokens`` of input (an embedding's, once encoded), holding them of the
        key's tokens per minute.

        Raises:
            Refusal: 429, the key's tokens per minute do not hold them now (or ever).
        """
        self.prompt = (self.prompt or 0) + tokens
        await self._take(tokens, self.reserved + tokens)

    async def _take(self, tokens: int, asked: int) -> None:
        """Hold ``tokens`` more of the key's tokens per minute (``asked``: the request's
        whole ask, as a refusal tells it)."""
        if tokens <= 0 or self.tenant.limits.tokens_per_minute is None:
            return
        admission = self._admission
        tpm = self.tenant.limits.tokens_per_minute
        verdict = await admission.take(self.tenant, Ask(tokens=tokens))
        # (what it holds already counts too: a whole ask over the minute never fits)
        wait = None if asked > tpm else verdict.retry_after
        rates = Rates(verdict.requests, verdict.tokens, wait, verdict.refused_by)
        if not verdict.admitted:
            admission.metrics.rejected.labels("rate_limited").inc()
            raise Refusal(rate_limited(self.tenant.name, "tokens", asked, rates))
        self.reserved += tokens
        self.rates = rates

    async def settle(self, status: int, usage: Any = None) -> None:
        """The request ended with ``status``; ``usage`` is its response's token counts (a
        ``Usage`` event or anything with ``prompt_tokens``, ``completion_tokens`` and
        ``cached_tokens``; None: unknown). Frees its slots, gives back what it reserved
        beyond what it used (all of it when it never reached the engine; none of it when it
        did but ended without a count: a client gone, a failure), counts its usage. Safe
        to call more than once."""
        if self._settled:
            return
        self._settled = True
        admission = self._admission
        if self._slot:
            admission.release()
        prompt = self.prompt or 0
        output = cached = 0
        if usage is not None:
            prompt = getattr(usage, "prompt_tokens", prompt) or 0
            output = getattr(usage, "completion_tokens", 0) or 0
            cached = getattr(usage, "cached_tokens", 0) or 0
        admission.count(self.tenant.name, self.model, status, prompt, cached, output)
        if not self._limited:
            return
        if usage is not None:
            used = prompt + output
        else:  # never reached the engine (no prompt known), or ended without a count
            used = 0 if self.prompt is None else self.reserved
        back = Ask(
            requests=1 if status == 429 else 0,  # (refused at its prompt: did nothing)
            tokens=self.reserved - (0 if status == 429 else used),
            inflight=1 if self.tenant.limits.max_inflight is not None else 0,
        )
        if back.requests or back.tokens or back.inflight:
            await admission.give(self.tenant, back)


@final
class Admission:
    """Admits requests on their keys' terms (``guard``: the keys, their budgets, the
    server's ``max_inflight`` and ``max_queued``); counts each key's use in ``metrics``
    and ``ledger``."""

    __slots__ = ("_changed", "_events", "_queue", "_running", "guard", "ledger", "metrics")

    def __init__(self, guard: Guard, metrics: ServerMetrics, ledger: UsageLedger) -> None:
        self.guard = guard
        self.metrics = metrics
        self.ledger = ledger
        self._queue: FairQueue[_Turn] = FairQueue()
        #: generation requests holding one of max_inflight's slots
        self._running = 0
        #: admission events (arrivals and admissions), numbered in order
        self._events = itertools.count(1)
        self._changed: anyio.Event | None = None

    def changed(self) -> anyio.Event:
        """An event set at the queue's next change (a request queued, or one leaving it):
        what a status view or a test waits on instead of polling :attr:`waiting`."""
        if self._changed is None:
            self._changed = anyio.Event()
        return self._changed

    def _tell(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @property
    def waiting(self) -> int:
        """Generation requests waiting for a slot."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Generation requests holding a slot."""
        return self._running

    async def enter(
        self,
        tenant: Tenant,
        receive: Receive,
        *,
        model: str = "",
        tokens: int = 0,
        cost: int | None = None,
        priority: int = 0,
        slot: bool = False,
        time_limit: float | None = None,
    ) -> Ticket:
        """Admit a request of ``tenant`` (on ``model``; ``receive``: its ASGI channel, to
        notice a client that leaves while it waits): a request and ``tokens`` of its key's
        limits, and with ``slot`` one of ``max_inflight``'s, waiting in the fair queue at
        ``priority`` (``cost``: its tokens as the queue weighs them) for at most
        ``time_limit`` seconds.

        Raises:
            Refusal: 429 (a limit of the key), 503 (no slot, the queue full), 504 (its
                deadline passed while it waited).
            ClientGone: the client left while it waited.
        """
        arrival = next(self._events)
        limits = tenant.limits
        rates: Rates | None = None
        ask = Ask(1, tokens, 1 if limits.max_inflight is not None else 0)
        if limits.any:
            verdict = await self.take(tenant, ask)
            rates = Rates(verdict.requests, verdict.tokens, verdict.retry_after, verdict.refused_by)
            if not verdict.admitted:
                self.metrics.rejected.labels("rate_limited").inc()
                self.count(tenant.name, model, 429)
                refused_by = verdict.refused_by or "requests"
                asked = ask.tokens if refused_by == "tokens" else 1
                raise Refusal(rate_limited(tenant.name, refused_by, asked, rates))
        order = arrival
        limit = self.guard.max_inflight
        if slot and limit is not None:
            try:
                order = await self._slot(receive, tenant, priority, cost, time_limit)
            except BaseException as exc:
                if isinstance(exc, Refusal):
                    self.count(tenant.name, model, 504 if exc.error.kind == "timeout" else 503)
                if limits.any:
                    await self.give(tenant, ask)
                raise
        return Ticket(
            self,
            tenant,
            model,
            reserved=tokens if limits.tokens_per_minute is not None else 0,
            slot=slot and limit is not None,
            rates=rates,
            arrival=arrival,
            order=order,
        )

    async def _slot(
        self,
        receive: Receive,
        tenant: Tenant,
        priority: int,
        cost: int | None,
        time_limit: float | None,
    ) -> int:
        """Take a slot of ``max_inflight``, waiting for one if the queue has room; the
        admission's number."""
        limit = self.guard.max_inflight
        assert limit is not None
        queue = self._queue
        start = queue.tag(
            priority, tenant.name, tenant.share, DEFAULT_COST if cost is None else cost
        )
        if self._running < limit and not queue:
            queue.started(priority, start)
            self._running += 1
            return next(self._events)
        if len(queue) >= self.guard.max_queued:
            last = queue.last()
            if last is None or (priority, start) >= (last.priority, last.start):
                self.metrics.rejected.labels("max_inflight").inc()
                raise Refusal(at_capacity(limit))
            queue.remove(last)  # gives way to the newcomer, which goes before it
            last.item.evicted = True
            last.item.event.set()
        turn = _Turn()
        entry = queue.push(turn, priority=priority, start=start, arrival=anyio.current_time())
        gone = False
        self.metrics.waiting.inc()
        self._tell()
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    nonlocal gone
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    gone = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                deadline = None if time_limit is None else anyio.current_time() + time_limit
                with nullcontext() if deadline is None else anyio.move_on_at(deadline):
                    await turn.event.wait()
                tg.cancel_scope.cancel()
        except BaseException:
            if turn.granted:
                self.release()
            else:
                queue.remove(entry)
            raise
        finally:
            self.metrics.waiting.dec()
            self._tell()
        if turn.granted:
            return turn.admitted
        queue.remove(entry)
        if turn.closed:
            raise Refusal(shut_down())
        if turn.evicted:
            self.metrics.rejected.labels("max_inflight").inc()
            raise Refusal(at_capacity(limit))
        if gone:
            raise ClientGone
        self.metrics.timed_out.inc()
        raise Refusal(timed_out(time_limit or 0.0))

    async def take(self, tenant: Tenant, ask: Ask) -> Verdict:
        """Take ``ask`` of ``tenant``'s budget (:attr:`Guard.budgets <.guard.Guard.budgets>`;
        this process's without awaiting)."""
        budgets = self.guard.budgets
        if isinstance(budgets, LocalBudgets):
            return budgets.take_now(tenant, ask)
        return await budgets.take(tenant, ask)

    async def give(self, tenant: Tenant, back: Ask) -> None:
        """Give ``back`` to ``tenant``'s budget, whatever cancels the caller (a shared
        store's round trip shielded, bounded by :data:`_SETTLE_TIMEOUT`)."""
        budgets = self.guard.budgets
        if isinstance(budgets, LocalBudgets):
            budgets.give_now(tenant, back)
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SETTLE_TIMEOUT):
            await budgets.give(tenant, back)

    def close(self) -> None:
        """Refuse every request waiting for a slot (the server is shutting down: 503)."""
        queue = self._queue
        while queue:
            turn = queue.pop()
            turn.closed = True
            turn.event.set()

    def release(self) -> None:
        """A slot is free: the next waiting request (the fair queue's) takes it."""
        self._running -= 1
        limit = self.guard.max_inflight
        queue = self._queue
        while queue and (limit is None or self._running < limit):
            turn = queue.pop()
            self._running += 1
            turn.granted = True
            turn.admitted = next(self._events)
            turn.event.set()

    def count(
        self, key: str, model: str, status: int, prompt: int = 0, cached: int = 0, output: int = 0
    ) -> None:
        """Count one request of ``key`` on ``model`` that ended with ``status``."""
        self.ledger.record(key, model, status=status, prompt=prompt, cached=cached, output=output)
        self.metrics.count_key(key, model, status, prompt, cached, output)
