"""KvRouter: a routing policy that sends a request where its prompt prefix is already cached.

A worker that holds a request's leading blocks in its KV cache skips their prefill, so a
conversation's next turn, or any prompt sharing a long system prompt, is cheapest on the
worker that served the previous one, unless that worker is busy. The policy weighs both in
one unit, prompt tokens of prefill (:mod:`pipeline.worker_load`)::

    cost(worker) = prompt tokens the worker does not hold * overlap_weight     (predicted)
                   + this router's requests there: their predicted prefill,     (ledger)
                     decode_weight per sequence
                   + what its last report counts besides them                   (reported)

and picks the cheapest (ties broken at random), or, with ``temperature > 0``, samples with
probability proportional to ``exp(-cost / temperature)``.

Why this cannot collapse onto one worker, as a count of requests did (a cached block
outweighed a queued request whatever that request cost, so one hot prefix drew every
request to one worker): a cache hit is worth exactly the prefill it saves, and a queue
costs exactly the prefill and decoding in it, so a worker holding a hot prefix takes
requests only until its queue is as long as the prefix, then the next one goes elsewhere
(and caches the prefix there too). The router's own requests are counted as it sends them
(a burst between two reports does not herd). Equal costs are broken at random.
And a guard: while some worker is idle, a busy worker that received more than ``balance``
times its share of the recent requests (``balance * mean + 1``, decayed over the last
``8 * workers`` decisions, at least 32) is passed over for one that did not: idle capacity
is never left idle for a small saving (:mod:`pipeline.balance`).

A worker that keeps blocks below its working cache (host memory, disk: KV events with a
``tier``, see :mod:`pipeline.kv_tier`) can restore them instead of prefilling them, which
is much cheaper but not free: such blocks continue the leading run at ``restore_cost`` of a
miss each, so a conversation evicted from a worker's slots but kept in its RAM still goes
back to it, unless a worker holds it on the device.

**Affinity.** A request naming its conversation (``session(ctx)``: OpenAI's
``prompt_cache_key``, an ``x-session-affinity`` header) goes where its conversation's
last request went (within ``affinity_ttl`` seconds of it) while that worker's load allows:
while its load alone is no more than the cheapest worker's whole cost (even if it held
nothing of the prompt it would be no worse), and the guard does not pass it over.

Where the holdings come from:

- **KV events** (engines that report their cache): the engine's events feed the
  :class:`~pipeline.prefix_index.PrefixIndex` the router was given (``index.apply``),
  through whatever transport carries them. The router only reads the index.
- **Approximation** (``approximate=True``, engines that report nothing, e.g. a user's):
  the router assumes each worker caches what was routed to it, for ``ttl`` seconds from
  the last request that brought those blocks. It writes that belief into the index
  itself, so the index should not also be fed by events. Approximated blocks expire when
  the next decision is made after their ttl passed. Writing a routed prompt's blocks is
  the costly part of a decision (~0.4-0.8 µs of Python per new block: ~230 µs for a new
  4096-token prompt), so the router keys a prompt by its first ``stride - 1`` blocks,
  then every ``stride``-th and the last (default 8): chained ids make one key name its
  whole prefix, the holdings are known to within ``stride`` blocks (less than the guess
  itself is worth), and the same decision costs ~35 µs (``benchmarks/bench_kv_index.py``).

The router sees only the candidates it is offered, so a worker that left its WorkerSet is
never chosen; its entries stay in the index until whoever follows membership (discovery)
calls ``index.remove_worker(worker_id)``, which should happen when the worker dies, not
when its discovery key expires.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, final

from .affinity import Affinity
from .balance import RecentShares
from .prefix_index import PrefixIndex
from .worker_load import DECODE_WEIGHT, PREDICTED_PREFILL, Prediction, WorkerLoad

if TYPE_CHECKING:
    from .context import Context
    from .routers import Worker

__all__ = ("KvRouter", "engine_report")

#: ``on_decision(worker_id, hit_blocks, miss_blocks)``, called once per routed request
DecisionCallback = Callable[[str, int, int], None]


def engine_report(worker: Worker[Any, Any]) -> WorkerLoad | None:
    """The load ``worker``'s engine reports (``engine.load_report()``), if it reports one."""
    load_report = getattr(worker.engine, "load_report", None)
    return load_report() if load_report is not None else None


@final
class KvRouter:
    """A :class:`~pipeline.routers.RoutingPolicy` that prefers workers caching the prefix,
    weighing their load in the same unit (prompt tokens of prefill).

    Args:
        index: what each worker holds (fed by KV events, or by this router when
            ``approximate``).
        block_ids: the request's chained block ids, in order (the LLM layer passes
            ``operators.routing.kv_blocks.request_block_ids(block_size)``).
        block_size: tokens per block.
        prompt_tokens: the request's prompt length in tokens (None: its blocks' tokens).
        overlap_weight: the cost of one prompt token to prefill, against one of queued work.
            2 by default: a prefill is paid twice, by the request waiting for it and by
            every request queued after it on that worker (1 weighs the request's own wait
            alone; lower spreads load more, higher keeps prompts nearer their cache).
        restore_cost: the cost of restoring one block from a worker's lower tier (host
            memory, disk), as a fraction of prefilling it: 0 counts it as held on the
            device, 1 as missing.
        decode_weight: prompt tokens one sequence a worker holds is worth
            (:mod:`pipeline.worker_load`).
        balance: while a worker is idle, a busy worker over ``balance`` times its share of
            the recent requests is passed over (0: never).
        temperature: 0 picks the cheapest; above 0 samples ``exp(-cost / temperature)``.
        load: a worker's load in prompt tokens, replacing the default (its report, and this
            router's ledger: :meth:`work`).
        report: a worker's own report of its load (default: its engine's ``load_report()``).
        session: the conversation a request belongs to (None: no affinity).
        affinity_ttl: how long a conversation sticks to its worker after its last request.
        seed: seeds the tie-breaking and sampling (tests, reproducible benchmarks).
        approximate: assume each worker caches what was routed to it, for ``ttl`` seconds.
        ttl: how long an approximated block stays cached after its last request.
        stride: when approximating, remember and look up every ``stride``-th block only
            (and a prompt's last block): one chained id names its whole prefix, so the
            holdings are known to ``stride`` blocks, for ``1 / stride`` of the index work
            (writing a routed prompt's new blocks is the costly part: ~0.4-0.8 µs each).
        clock: seconds, monotonic (tests inject a fake one).
        on_decision: called with ``(worker_id, hit_blocks, miss_blocks)`` for every
            decision: the metrics hook (hit and miss blocks, decisions per worker). It runs
            on the routing path, so it must be quick and must not raise.
    """

    __slots__ = (
        "_affinity",
        "_block_ids",
        "_block_size",
        "_clock",
        "_expiring",
        "_expiry",
        "_load",
        "_on_decision",
        "_prompt_tokens",
        "_random",
        "_recent",
        "_report",
        "_session",
        "_stride",
        "_ttl",
        "approximate",
        "balance",
        "decode_weight",
        "index",
        "overlap_weight",
        "restore_cost",
        "temperature",
    )

    def __init__(
        self,
        index: PrefixIndex,
        block_ids: Callable[[Context[Any]], Sequence[Hashable]],
        *,
        block_size: int = 1,
        prompt_tokens: Callable[[Context[Any]], int] | None = None,
        overlap_weight: float = 2.0,
        restore_cost: float = 0.1,
        decode_weight: float = DECODE_WEIGHT,
        balance: float = 1.5,
        temperature: float = 0.0,
        load: Callable[[Worker[Any, Any]], float] | None = None,
        report: Callable[[Worker[Any, Any]], WorkerLoad | None] = engine_report,
        session: Callable[[Context[Any]], str | None] | None = None,
        affinity_ttl: float = 300.0,
        seed: int | None = None,
        approximate: bool = False,
        ttl: float = 120.0,
        stride: int = 8,
        clock: Callable[[], float] = time.monotonic,
        on_decision: DecisionCallback | None = None,
    ) -> None:
        for name, value in (
            ("overlap_weight", overlap_weight),
            ("decode_weight", decode_weight),
            ("temperature", temperature),
        ):
            if value < 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not 0 <= restore_cost <= 1:  # also rejects NaN
            raise ValueError(f"restore_cost must be between 0 and 1, got {restore_cost}")
        if not (balance == 0 or 1 <= balance < math.inf):
            raise ValueError(f"balance must be 0 (off) or at least 1, got {balance}")
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        #: the prefix index this router reads (and, when approximating, writes)
        self.index = index
        self.overlap_weight = overlap_weight
        self.restore_cost = restore_cost
        self.decode_weight = decode_weight
        self.balance = balance
        self.temperature = temperature
        self.approximate = approximate
        self._block_ids = block_ids
        self._block_size = block_size
        self._prompt_tokens = prompt_tokens
        self._load = load
        self._report = report
        self._session = session
        self._affinity = Affinity(affinity_ttl)
        self._random = random.Random(seed)
        self._ttl = ttl
        self._stride = stride if approximate else 1
        self._clock = clock
        self._on_decision = on_decision
        # the guard's recent requests per worker
        self._recent = RecentShares()
        # approximation: worker -> block -> when it expires; and the routed batches in
        # expiry order (ttl is constant, so appending keeps the deque sorted)
        self._expiry: dict[str, dict[Hashable, float]] = {}
        self._expiring: deque[tuple[float, str, Sequence[Hashable]]] = deque()

    # -- load ---------------------------------------------------------------------------------

    def report(self, worker: Worker[Any, Any]) -> WorkerLoad | None:
        """What ``worker`` last said of its load (None: nothing)."""
        return self._report(worker)

    def work(self, worker: Worker[Any, Any]) -> float:
        """``worker``'s load as this router weighs it, in prompt tokens: this router's own
        requests there (its ledger), and what its report counts besides them."""
        if self._load is not None:
            return self._load(worker)
        weight = self.decode_weight
        ledger = worker.ledger
        own = max(ledger.work(weight), weight * worker.in_flight)
        report = self._report(worker)
        if report is None:
            return own
        return own + ledger.others(report, weight)

    def recent_share(self, worker_id: str) -> float:
        """The requests sent ``worker_id`` recently (decayed), as the guard counts them."""
        return self._recent[worker_id]

    # -- choosing -----------------------------------------------------------------------------

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """The cheapest worker for ``ctx`` (or a sample, with a temperature), unless its
        conversation's worker may keep it or the guard passes the choice over."""
        blocks = self._block_ids(ctx)
        total = len(blocks)
        size = self._block_size
        prompt = self._prompt_tokens(ctx) if self._prompt_tokens is not None else total * size
        now = self._clock()
        keys = blocks
        if self.approximate:
            self._expire(now)
            if self._stride > 1:
                keys = self._sparse(blocks)
        lower: dict[str, int] = {}
        if not self.approximate and keys and self.index.tiers():
            tiered = self.index.tiered_overlaps(keys)
            overlaps = {worker: device for worker, (device, _) in tiered.items()}
            lower = {worker: more for worker, (_, more) in tiered.items() if more}
        else:
            overlaps = self.index.overlaps(keys) if keys else {}
        held = overlaps
        if keys is not blocks:
            held = {worker: self._held(found, keys, total) for worker, found in overlaps.items()}
        elif blocks:  # what a worker will hold once the prompts queued there are prefilled
            held = dict(held)
            for worker in workers:
                queued = worker.ledger.queued_overlap(blocks, held.get(worker.id, 0))
                if queued:
                    held[worker.id] = queued
        works = [self.work(worker) for worker in workers]
        restore = self.restore_cost
        predicted = []
        for worker in workers:
            device = min(held.get(worker.id, 0) * size, prompt)
            restored = min(lower.get(worker.id, 0) * size, prompt - device)
            predicted.append(prompt - device - restored + restore * restored)
        weight = self.overlap_weight
        costs = [p * weight + w for p, w in zip(predicted, works, strict=True)]
        if self.temperature > 0 and len(workers) > 1:
            chosen = self._sample(costs)
        else:
            chosen = self._cheapest(costs, range(len(costs)))
        session = self._session(ctx) if self._session is not None else None
        if session is not None:
            chosen = self._stick(session, workers, costs, works, chosen, now)
        chosen = self._guard(workers, costs, works, chosen)
        worker = workers[chosen]
        self._recent.count(worker.id, len(workers))
        if session is not None:
            self._affinity.put(session, worker.id, now)
        ctx.state.set(
            PREDICTED_PREFILL,
            Prediction(predicted[chosen], () if self.approximate else blocks, prompt),
        )
        hit = held.get(worker.id, 0) + lower.get(worker.id, 0)
        if self.approximate and keys:
            self._remember(worker.id, keys, overlaps.get(worker.id, 0), now + self._ttl)
        if self._on_decision is not None:
            self._on_decision(worker.id, hit, total - hit)
        span = ctx.span
        if span is not None:  # a traced request: what the chosen worker had of its prompt
            span.set("llm_pipeline.kv.prompt_blocks", total)
            span.set("llm_pipeline.kv.overlap_blocks", hit)
            span.set("llm_pipeline.kv.predicted_prefill_tokens", predicted[chosen])
            span.set("llm_pipeline.kv.worker_load_tokens", works[chosen])
        return worker

    def _stick(
        self,
        session: str,
        workers: Sequence[Worker[Any, Any]],
        costs: list[float],
        works: list[float],
        chosen: int,
        now: float,
    ) -> int:
        """The conversation's worker, while its load allows (see the module docstring)."""
        previous = self._affinity.get(session, now)
        if previous is None:
            return chosen
        for i, worker in enumerate(workers):
            if worker.id == previous:
                return i if works[i] <= costs[chosen] else chosen
        return chosen

    def _guard(
        self,
        workers: Sequence[Worker[Any, Any]],
        costs: list[float],
        works: list[float],
        chosen: int,
    ) -> int:
        """``chosen``, unless it is busy, over its share of the recent requests, and some
        worker is idle: then the cheapest of the idle and the workers under their share."""
        count = len(workers)
        if not self.balance or count < 2:
            return chosen
        idle = {i for i, w in enumerate(workers) if works[i] <= 0 and w.in_flight == 0}
        if not idle or chosen in idle:
            return chosen
        recent = self._recent
        limit = recent.limit(self.balance, [w.id for w in workers])
        if recent[workers[chosen].id] < limit:
            return chosen
        allowed = [i for i, w in enumerate(workers) if i in idle or recent[w.id] < limit]
        return self._cheapest(costs, allowed)

    def _held(self, found: int, keys: Sequence[Hashable], total: int) -> int:
        """The blocks a worker holding the first ``found`` sparse ``keys`` holds: all of
        them when it holds every key, else up to its last key's block."""
        if found == len(keys):
            return total
        stride = self._stride
        return found if found < stride else (found - stride + 1) * stride

    def _sparse(self, blocks: Sequence[Hashable]) -> list[Hashable]:
        """The first ``stride - 1`` blocks, then every ``stride``-th, then the last: the
        same positions for every prompt, so a longer prompt's keys extend a shorter one's
        up to its last full stride, and a short prompt (a first turn) is keyed whole."""
        stride = self._stride
        keys = list(blocks[: stride - 1])
        keys += blocks[stride - 1 :: stride]
        if len(blocks) >= stride and len(blocks) % stride:
            keys.append(blocks[-1])
        return keys

    def _cheapest(self, costs: list[float], among: Sequence[int]) -> int:
        best = min(costs[i] for i in among)
        tied = [i for i in among if costs[i] == best]
        return tied[0] if len(tied) == 1 else self._random.choice(tied)

    def _sample(self, costs: list[float]) -> int:
        # Shifted by the minimum: the weights are those of the costs themselves, and the
        # cheapest worker's is exp(0) = 1, so nothing overflows or vanishes entirely.
        best = min(costs)
        temperature = self.temperature
        weights = [math.exp((best - cost) / temperature) for cost in costs]
        return self._random.choices(range(len(costs)), weights)[0]

    def _remember(self, worker: str, blocks: Sequence[Hashable], held: int, expires: float) -> None:
        """``worker`` caches ``blocks`` (it holds the first ``held`` already) until
        ``expires``, or a later request for them."""
        blocks = tuple(blocks)  # the caller's list may change later
        if held < len(blocks):  # the index has the first ``held``: only their ttl changes
            self.index.stored(worker, blocks[held:] if held else blocks)
        self._expiry.setdefault(worker, {}).update(dict.fromkeys(blocks, expires))
        self._expiring.append((expires, worker, blocks))

    def _expire(self, now: float) -> None:
        """Drop approximated blocks whose ttl passed since their last request."""
        expiring = self._expiring
        while expiring and expiring[0][0] <= now:
            expires, worker, blocks = expiring.popleft()
            expiry = self._expiry.get(worker)
            if expiry is None:
                continue
            # Blocks routed here again since carry a later expiry: they stay.
            gone = [block for block in blocks if expiry.get(block) == expires]
            for block in gone:
                del expiry[block]
            if not expiry:
                del self._expiry[worker]
            self.index.removed(worker, gone)

    def __repr__(self) -> str:
        mode = f", approximate ttl={self._ttl:g}s" if self.approximate else ""
        if self._stride > 1:
            mode += f" stride={self._stride}"
        return (
            f"KvRouter(weight={self.overlap_weight:g}, restore_cost={self.restore_cost:g}, "
            f"decode_weight={self.decode_weight:g}, balance={self.balance:g}, "
            f"temperature={self.temperature:g}{mode}, "
            f"{self.index!r})"
        )
