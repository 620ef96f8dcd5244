"""A discrete-event simulation of a router over workers with a mocker-like timing model.

What the KV router's properties are checked on (``test_kv_routing_properties.py``): the
real :class:`~pipeline.KvRouter` (or any policy) decides, each simulated worker keeps a
prefix cache, a batch, a queue and a step clock, and reports its load as an in-process
engine does (``load_report()``, exact as of now); the ledger is booked as the
:class:`~pipeline.Router` books it (sent, first output, ended). No event loop: time is
the simulation's, so a trace of thousands of requests runs in milliseconds.

The timing model (the mocker's, with chunked prefill): a step lasts ``decode_s`` plus
``prefill_s`` per prompt token it prefills, at most ``step_tokens`` of them; each
sequence past its prefill gets one token per step; a worker runs ``max_batch`` sequences
at most, the others wait. A prompt's leading blocks found in the cache are not prefilled;
its blocks are cached (LRU, ``cache_blocks``) as each chunk of its prefill is computed,
and reported to the prefix index then, as KV events would be.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline import Context, PrefixIndex, RoutingPolicy, Worker, WorkerLoad
from pipeline.testing import make_context
from pipeline.worker_load import PREDICTED_PREFILL, Sent

BLOCK = 64


@dataclass(frozen=True)
class Request:
    """One request of a trace: when, its prompt's chained block ids, its sizes."""

    at: float
    blocks: tuple[int, ...]
    prompt: int
    output: int
    session: str | None = None


def chain(raw: Sequence[int], salt: int = 0) -> tuple[int, ...]:
    """Chained block ids of raw block contents (an id names its whole prefix)."""
    ids: list[int] = []
    parent = salt
    for value in raw:
        parent = hash((parent, value))
        ids.append(parent)
    return tuple(ids)


@dataclass(frozen=True)
class Timing:
    prefill_s: float = 0.05e-3
    decode_s: float = 5e-3
    decode_token_s: float = 0.05e-3
    step_tokens: int = 4096
    max_batch: int = 64
    cache_blocks: int = 4096


@dataclass
class _Seq:
    request: Request
    worker: SimWorker
    sent: Sent
    arrived: float
    estimate: int  # its prefill as the cache stood when it arrived
    prefill_left: int = -1  # unknown until admitted
    generated: int = 0
    hit_tokens: int = 0


@dataclass
class Decision:
    """One routing decision, with the state the test judges it by."""

    worker: str
    busy: frozenset[str]  # workers holding any request just before it


@dataclass
class Outcome:
    decisions: list[Decision] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    received: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class SimWorker:
    """One simulated worker: the engine of a :class:`~pipeline.Worker`."""

    def __init__(self, name: str, sim: Simulation, timing: Timing) -> None:
        self.name = name
        self._sim = sim
        self._timing = timing
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.stepping = False

    def load_report(self) -> WorkerLoad:
        prefill = sum(self._left(seq) for seq in itertools.chain(self.waiting, self.running))
        decoding = sum(1 for seq in self.running if seq.generated)
        return WorkerLoad(
            prefill_tokens=prefill,
            decoding=decoding,
            waiting=len(self.waiting) + len(self.running) - decoding,
            at=self._sim.now,
        )

    @staticmethod
    def _left(seq: _Seq) -> int:
        return seq.prefill_left if seq.prefill_left >= 0 else seq.estimate

    def hit(self, blocks: Sequence[int]) -> int:
        hit = 0
        for block in blocks:
            if block not in self.cache:
                break
            hit += 1
        return min(hit, len(blocks))

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> None:
        """Start a step: admit, cut the prefill chunk, schedule its end."""
        timing = self._timing
        while self.waiting and len(self.running) < timing.max_batch:
            self.running.append(self.waiting.popleft())
        budget = timing.step_tokens
        chunks: list[tuple[_Seq, int]] = []
        decoding = 0
        for seq in self.running:
            if seq.prefill_left < 0 and budget > 0:  # its prefill starts: what is cached now
                hit = min(self.hit(seq.request.blocks) * BLOCK, seq.request.prompt)
                for block in seq.request.blocks[: hit // BLOCK]:
                    self.cache.move_to_end(block)
                seq.hit_tokens = hit
                seq.prefill_left = seq.request.prompt - hit
            if seq.prefill_left > 0 and budget > 0:
                take = min(seq.prefill_left, budget)
                budget -= take
                chunks.append((seq, take))
            elif seq.prefill_left == 0:
                decoding += 1
        prefilled = timing.step_tokens - budget
        self.stepping = True
        cost = timing.decode_s + timing.prefill_s * prefilled + timing.decode_token_s * decoding
        end = self._sim.now + cost
        self._sim.at(end, lambda: self._end_step(chunks))

    def _end_step(self, chunks: list[tuple[_Seq, int]]) -> None:
        sim = self._sim
        for seq, take in chunks:  # the blocks computed so far are cached, as vLLM caches
            seq.prefill_left -= take
            done = (seq.request.prompt - seq.prefill_left) // BLOCK
            self._store(seq.request.blocks[:done])
        for seq in list(self.running):
            if seq.prefill_left != 0:
                continue
            if seq.generated == 0:  # its first token
                sim.first_token(seq)
            seq.generated += 1
            if seq.generated >= seq.request.output:
                self.running.remove(seq)
                sim.finished(seq)
        self.stepping = False
        if self.busy():
            self.step()

    def _store(self, blocks: Sequence[int]) -> None:
        cache = self.cache
        new = [block for block in blocks if block not in cache]
        for block in blocks:
            cache[block] = None
            cache.move_to_end(block)
        evicted = []
        while len(cache) > self._timing.cache_blocks:
            block, _ = cache.popitem(last=False)
            evicted.append(block)
        index = self._sim.index
        if new:
            index.stored(self.name, new)
        if evicted:
            index.removed(self.name, evicted)


class Simulation:
    """Runs a trace through ``policy`` over ``names`` workers."""

    def __init__(
        self,
        policy: RoutingPolicy,
        names: Sequence[str],
        index: PrefixIndex,
        timing: Timing = Timing(),
    ) -> None:
        self.policy = policy
        self.index = index
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.engines = {name: SimWorker(name, self, timing) for name in names}
        self.workers = [Worker(name, self.engines[name]) for name in names]
        self._by_name = {worker.id: worker for worker in self.workers}
        self.outcome = Outcome(received=dict.fromkeys(names, 0))

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def run(self, trace: Sequence[Request]) -> Outcome:
        for request in trace:
            self.at(request.at, lambda request=request: self._arrive(request))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return self.outcome

    def _arrive(self, request: Request) -> None:
        ctx: Context[Request] = make_context(request)
        busy = frozenset(name for name, engine in self.engines.items() if engine.busy())
        worker = self.policy.choose(self.workers, ctx)
        if PREDICTED_PREFILL in ctx.state:  # booked as the Router books it
            predicted = ctx.state.pop(PREDICTED_PREFILL)
            sent = worker.ledger.sent(
                predicted.tokens, self.now, predicted.blocks, predicted.prompt
            )
        else:
            sent = worker.ledger.sent(0.0, self.now, (), request.prompt)
        worker.in_flight += 1
        self.outcome.decisions.append(Decision(worker.id, busy))
        self.outcome.received[worker.id] += 1
        engine = self.engines[worker.id]
        estimate = max(request.prompt - engine.hit(request.blocks) * BLOCK, 0)
        engine.waiting.append(_Seq(request, engine, sent, self.now, estimate))
        if not engine.stepping:
            engine.step()

    def first_token(self, seq: _Seq) -> None:
        outcome = self.outcome
        outcome.ttft.append(self.now - seq.arrived)
        outcome.prompt_tokens += seq.request.prompt
        outcome.hit_tokens += seq.hit_tokens
        self._by_name[seq.worker.name].ledger.prefilled(seq.sent)

    def finished(self, seq: _Seq) -> None:
        worker = self._by_name[seq.worker.name]
        worker.in_flight -= 1
        worker.ledger.ended(seq.sent)


def request_fields(ctx: Context[Any]) -> Request:
    data: Request = ctx.data
    return data


def blocks_of(ctx: Context[Any]) -> tuple[int, ...]:
    return request_fields(ctx).blocks


def prompt_of(ctx: Context[Any]) -> int:
    return request_fields(ctx).prompt


def session_of(ctx: Context[Any]) -> str | None:
    return request_fields(ctx).session


def recent_shares(decisions: Sequence[Decision], workers: int) -> Iterator[dict[str, float]]:
    """Before each decision, every worker's decayed count of the decisions so far (as the
    KV router's guard counts them), computed from the log alone."""
    decay = 1.0 - 1.0 / max(32, 8 * workers)
    counts: dict[str, float] = {}
    for decision in decisions:
        yield dict(counts)
        for name in counts:
            counts[name] *= decay
        counts[decision.worker] = counts.get(decision.worker, 0.0) + 1.0
