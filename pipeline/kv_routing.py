"""KvRouter: a routing policy that sends a request where its prompt prefix is already cached.

A worker that holds a request's leading blocks in its KV cache skips their prefill, so a
conversation's next turn, or any prompt sharing a long system prompt, is cheapest on the
worker that served the previous one, unless that worker is busy. The policy weighs both::

    cost(worker) = (request blocks - leading blocks the worker holds) * overlap_weight
                   + load(worker)

and picks the cheapest (ties broken at random), or, with ``temperature > 0``, samples with
probability proportional to ``exp(-cost / temperature)`` so that near-equal workers share
the traffic instead of one taking every request until its load tips the balance.

A worker that keeps blocks below its working cache (host memory, disk: KV events with a
``tier``, see :mod:`pipeline.kv_tier`) can restore them instead of prefilling them, which
is much cheaper but not free. Such blocks continue the leading run at ``restore_cost`` of
a miss each::

    cost(worker) = (missed blocks + restore_cost * lower-tier blocks) * overlap_weight
                   + load(worker)

so a conversation evicted from a worker's slots but kept in its RAM still goes back to it,
unless a worker holds it on the device.

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

The units matter: ``overlap_weight`` converts blocks to ``load`` units. With the default
load (requests in flight on the worker, from the WorkerSet), weight 1.0 says one block of
prefill saved is worth one request queued; set it lower to spread load more, or pass a
``load`` in blocks (e.g. the engine's active KV blocks) to compare like with like.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, final

from .prefix_index import PrefixIndex

if TYPE_CHECKING:
    from .context import Context
    from .routers import Worker

__all__ = ("KvRouter",)

#: ``on_decision(worker_id, hit_blocks, miss_blocks)``, called once per routed request
DecisionCallback = Callable[[str, int, int], None]


def _in_flight(worker: Worker[Any, Any]) -> float:
    return worker.in_flight


@final
class KvRouter:
    """A :class:`~pipeline.routers.RoutingPolicy` that prefers workers caching the prefix.

    Args:
        index: what each worker holds (fed by KV events, or by this router when
            ``approximate``).
        block_ids: the request's chained block ids, in order (the LLM layer passes
            ``operators.routing.kv_blocks.request_block_ids(block_size)``).
        overlap_weight: the cost of one block to prefill, in ``load`` units.
        restore_cost: the cost of restoring one block from a worker's lower tier (host
            memory, disk), as a fraction of prefilling it: 0 counts it as held on the
            device, 1 as missing.
        temperature: 0 picks the cheapest; above 0 samples ``exp(-cost / temperature)``.
        load: a worker's current load (default: its requests in flight).
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
        "_block_ids",
        "_clock",
        "_expiring",
        "_expiry",
        "_load",
        "_on_decision",
        "_random",
        "_stride",
        "_ttl",
        "approximate",
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
        overlap_weight: float = 1.0,
        restore_cost: float = 0.1,
        temperature: float = 0.0,
        load: Callable[[Worker[Any, Any]], float] = _in_flight,
        seed: int | None = None,
        approximate: bool = False,
        ttl: float = 120.0,
        stride: int = 8,
        clock: Callable[[], float] = time.monotonic,
        on_decision: DecisionCallback | None = None,
    ) -> None:
        if overlap_weight < 0 or not math.isfinite(overlap_weight):
            raise ValueError(f"overlap_weight must be finite and >= 0, got {overlap_weight}")
        if not 0 <= restore_cost <= 1:  # also rejects NaN
            raise ValueError(f"restore_cost must be between 0 and 1, got {restore_cost}")
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        #: the prefix index this router reads (and, when approximating, writes)
        self.index = index
        self.overlap_weight = overlap_weight
        self.restore_cost = restore_cost
        self.temperature = temperature
        self.approximate = approximate
        self._block_ids = block_ids
        self._load = load
        self._random = random.Random(seed)
        self._ttl = ttl
        self._stride = stride if approximate else 1
        self._clock = clock
        self._on_decision = on_decision
        # approximation: worker -> block -> when it expires; and the routed batches in
        # expiry order (ttl is constant, so appending keeps the deque sorted)
        self._expiry: dict[str, dict[Hashable, float]] = {}
        self._expiring: deque[tuple[float, str, Sequence[Hashable]]] = deque()

    def choose(self, workers: Sequence[Worker[Any, Any]], ctx: Context[Any], /) -> Worker[Any, Any]:
        """The cheapest worker for ``ctx`` (or a sample, with a temperature)."""
        blocks = self._block_ids(ctx)
        total = len(blocks)
        now = 0.0
        keys = blocks
        if self.approximate:
            now = self._clock()
            self._expire(now)
            if self._stride > 1:
                keys = self._sparse(blocks)
        weight = self.overlap_weight
        load = self._load
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
        if lower:
            restore = self.restore_cost
            costs = [
                (total - held.get(worker.id, 0) - (1.0 - restore) * lower.get(worker.id, 0))
                * weight
                + load(worker)
                for worker in workers
            ]
            held = {
                worker: held.get(worker, 0) + lower.get(worker, 0) for worker in {*held, *lower}
            }
        else:
            costs = [(total - held.get(worker.id, 0)) * weight + load(worker) for worker in workers]
        if self.temperature > 0 and len(workers) > 1:
            chosen = self._sample(costs)
        else:
            chosen = self._cheapest(costs)
        worker = workers[chosen]
        hit = held.get(worker.id, 0)
        if self.approximate and keys:
            self._remember(worker.id, keys, overlaps.get(worker.id, 0), now + self._ttl)
        if self._on_decision is not None:
            self._on_decision(worker.id, hit, total - hit)
        span = ctx.span
        if span is not None:  # a traced request: what the chosen worker had of its prompt
            span.set("llm_pipeline.kv.prompt_blocks", total)
            span.set("llm_pipeline.kv.overlap_blocks", hit)
        return worker

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

    def _cheapest(self, costs: list[float]) -> int:
        best = min(costs)
        tied = [index for index, cost in enumerate(costs) if cost == best]
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
            f"temperature={self.temperature:g}{mode}, "
            f"{self.index!r})"
        )
