"""A worker's load in one unit: prompt tokens of prefill work, what it says and what we sent.

A router that counts requests in flight cannot tell a worker holding forty one-token
answers from one holding forty 32k-token prompts, and a KV router that weighs cached
blocks against such a count lets one hot prefix pull every request onto one worker (a
block saved outweighs a request queued, whatever that request costs). So the KV router
(:class:`~pipeline.kv_routing.KvRouter`) weighs everything in the unit a cache hit saves,
prompt tokens to prefill::

    work(worker) = queued prefill tokens + decode_weight * sequences it holds

- :class:`WorkerLoad` is what a worker says of itself (engine-agnostic: an in-process
  engine answers at once, an upstream server's poll, a NATS worker's report): prompt tokens
  it accepted and has not computed, sequences decoding and waiting, its KV cache usage, and
  ``at``, the time on the router's clock before which every request sent is counted in it.
- :class:`LoadLedger` is what one router knows of its own requests to one worker (each
  :class:`~pipeline.routers.Worker` has one; :class:`~pipeline.routers.Router` keeps it):
  the prefill it predicted for each (the policy leaves a :class:`Prediction` in the
  request's state under :data:`PREDICTED_PREFILL`), whether its first output came (its
  prefill is done), and when it was sent.

The router's own requests are known exactly and at once, so they are weighed from the
ledger (their predicted prefill, which knows what the worker caches and what it is about to
cache: a report counts a queued prompt whole); the report adds what is not ours
(:meth:`LoadLedger.others`): its counts less our requests it can have counted, those sent
before ``at`` (at their whole prompt, so nothing of ours is counted twice). A report is old
the moment it is made: what this router sent since is in the ledger already, so a burst
between two reports does not all go to the worker that looked idle at the last one. A
worker that reports nothing is weighed by the ledger alone.

Why decode sequences count in prefill tokens: a sequence decoding takes a token of every
engine step (and a batch slot, and KV memory) while it lives; ``decode_weight`` says how
many prompt tokens of prefill one is worth (16 by default: a conversation's cache of
1,000 tokens outweighs sixty decoding sequences, a 100-token prompt six).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, Protocol, final

from .context import StateKey

__all__ = (
    "DECODE_WEIGHT",
    "PREDICTED_PREFILL",
    "LoadLedger",
    "LoadReporter",
    "Prediction",
    "Sent",
    "WorkerLoad",
)

#: prompt tokens of prefill one sequence held by a worker is worth (the default)
DECODE_WEIGHT: Final = 16.0


class Prediction(NamedTuple):
    """What a routing policy predicted of a request on the worker it chose."""

    #: prompt tokens it will prefill there
    tokens: float
    #: its prompt's chained block ids (what the worker will hold once it is prefilled)
    blocks: Sequence[Hashable] = ()
    #: its whole prompt, in tokens
    prompt: float = 0.0


#: the routing policy's :class:`Prediction` for a request on the worker it chose; the
#: :class:`~pipeline.routers.Router` books it in that worker's ledger
PREDICTED_PREFILL: StateKey[Prediction] = StateKey("prefill predicted by the routing policy")

#: requests remembered per ledger for :meth:`LoadLedger.since`, at most (older ones are
#: older than any report that still matters)
_RECENT: Final = 4096


@final
@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker says of its own load (all of it: every router's and client's work)."""

    #: prompt tokens it accepted and has not computed yet (waiting requests' prompts, and
    #: what is left of prefills under way)
    prefill_tokens: int = 0
    #: sequences past their prefill (or running: a server that does not tell them apart)
    decoding: int = 0
    #: requests not decoding yet: waiting for room (a batch slot, KV memory) or prefilling
    waiting: int = 0
    #: the fraction of its KV cache in use (None: not said)
    kv_usage: float | None = None
    #: on the router's clock (``anyio.current_time()``), when the report was made or heard:
    #: the router takes its requests sent before as counted in it (stamp late rather than
    #: early: a request not counted after all is still counted once, as the router's own)
    at: float = -math.inf

    def work(self, decode_weight: float = DECODE_WEIGHT) -> float:
        """This load in prompt tokens of prefill."""
        return self.prefill_tokens + decode_weight * (self.decoding + self.waiting)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a wire (``at`` stays: the receiver stamps its own)."""
        plain: dict[str, Any] = {
            "prefill": self.prefill_tokens,
            "decoding": self.decoding,
            "waiting": self.waiting,
        }
        if self.kv_usage is not None:
            plain["kv"] = self.kv_usage
        return plain

    @classmethod
    def from_dict(cls, plain: Mapping[str, Any], at: float) -> WorkerLoad:
        """A report sent as :meth:`to_dict`, received at ``at`` (less the time it took).

        Raises:
            ValueError: a field is missing, negative or not a number.
        """
        try:
            prefill, decoding, waiting = (int(plain[key]) for key in _COUNTS)
            kv = plain.get("kv")
            usage = None if kv is None else float(kv)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a load report: {plain!r}") from exc
        if min(prefill, decoding, waiting) < 0:
            raise ValueError(f"a load report with a negative count: {plain!r}")
        return cls(prefill, decoding, waiting, usage, at)


_COUNTS: Final = ("prefill", "decoding", "waiting")


class LoadReporter(Protocol):
    """An engine that reports its load (routers look ``load_report`` up on the engine)."""

    def load_report(self) -> WorkerLoad | None:
        """The engine's load now (or as last heard; None: nothing to say). Read on the
        routing path: quick, no I/O."""
        ...


@final
class Sent:
    """One request a router sent a worker (a :class:`LoadLedger` entry)."""

    __slots__ = ("at", "blocks", "done", "prefilling", "prompt", "tokens")

    def __init__(
        self, tokens: float, at: float, blocks: Sequence[Hashable] = (), prompt: float = 0.0
    ) -> None:
        #: the prefill predicted for it there, in prompt tokens
        self.tokens = tokens
        #: its whole prompt, in tokens (what a worker's report may count it as)
        self.prompt = max(prompt, tokens)
        #: its prompt's chained block ids
        self.blocks = blocks
        #: when it was sent
        self.at = at
        #: no output came yet
        self.prefilling = True
        #: its stream ended
        self.done = False


@final
class LoadLedger:
    """One router's requests to one worker: booked by the :class:`~pipeline.routers.Router`
    (sent, first output, ended), read by the routing policy.

    Not thread-safe: the event loop that routes owns it.
    """

    __slots__ = (
        "_prefilling",
        "_recent",
        "prefill_tokens",
        "prompt_tokens",
        "requests",
        "sent_total",
    )

    def __init__(self) -> None:
        #: predicted prefill tokens of this router's requests there whose first output has
        #: not come yet
        self.prefill_tokens = 0.0
        #: the whole prompts of those requests
        self.prompt_tokens = 0.0
        #: this router's requests there, in flight
        self.requests = 0
        #: requests sent there since the ledger was made
        self.sent_total = 0
        self._recent: deque[Sent] = deque()
        self._prefilling: set[Sent] = set()

    def sent(
        self, tokens: float, at: float, blocks: Sequence[Hashable] = (), prompt: float = 0.0
    ) -> Sent:
        """A request predicted to prefill ``tokens`` of its ``prompt`` tokens there was sent
        at ``at``; once prefilled, the worker holds ``blocks``."""
        entry = Sent(tokens, at, blocks, prompt)
        if blocks:
            self._prefilling.add(entry)
        self.prefill_tokens += entry.tokens
        self.prompt_tokens += entry.prompt
        self.requests += 1
        self.sent_total += 1
        recent = self._recent
        recent.append(entry)
        if len(recent) > _RECENT:
            recent.popleft()
        return entry

    def prefilled(self, entry: Sent) -> None:
        """``entry``'s first output came: its prefill is done."""
        if entry.prefilling:
            entry.prefilling = False
            self.prefill_tokens -= entry.tokens
            self.prompt_tokens -= entry.prompt
            self._prefilling.discard(entry)

    def ended(self, entry: Sent) -> None:
        """``entry``'s stream ended, however."""
        if entry.done:
            return
        self.prefilled(entry)
        entry.done = True
        self.requests -= 1
        recent = self._recent
        while recent and recent[0].done:
            recent.popleft()

    def work(self, decode_weight: float = DECODE_WEIGHT) -> float:
        """This router's requests there, in prompt tokens of prefill."""
        return max(self.prefill_tokens, 0.0) + decode_weight * self.requests

    def pending(self) -> Iterable[Sequence[Hashable]]:
        """The prompts (block ids) of this router's requests there not prefilled yet: what
        the worker will hold by the time a request sent now is prefilled (a queue runs in
        order), which its KV events cannot say yet."""
        return [entry.blocks for entry in self._prefilling]

    def queued_overlap(self, blocks: Sequence[Hashable], held: int = 0) -> int:
        """The most leading ``blocks`` a prompt of ours prefilling there shares (0 when none
        shares more than ``held``, what the worker holds already). Ids are chained: prompts
        equal at block ``k`` are equal before it, so a prompt that differs at ``held``
        cannot share more, and the rest is a binary search."""
        best = held
        found = 0
        if best >= len(blocks):
            return 0
        for entry in self._prefilling:
            other = entry.blocks
            if len(other) <= best or other[best] != blocks[best]:
                continue
            low, high = best + 1, min(len(other), len(blocks))  # equal up to ``low``
            while low < high:
                middle = (low + high + 1) // 2
                if other[middle - 1] == blocks[middle - 1]:
                    low = middle
                else:
                    high = middle - 1
            best = found = low
            if best == len(blocks):
                break
        return found

    def others(self, report: WorkerLoad, decode_weight: float = DECODE_WEIGHT) -> float:
        """The work ``report`` counts that is not this router's: its counts less this
        router's requests it can have counted (sent before ``report.at``, still in flight,
        their prompts whole), never below zero. Forgets requests sent before ``at``."""
        recent = self._recent
        at = report.at
        while recent and recent[0].at <= at:
            recent.popleft()
        prompts_after, live_after = 0.0, 0
        for entry in recent:
            if not entry.done:
                live_after += 1
                if entry.prefilling:
                    prompts_after += entry.prompt
        prompts = max(report.prefill_tokens - (self.prompt_tokens - prompts_after), 0.0)
        sequences = max(report.decoding + report.waiting - (self.requests - live_after), 0)
        return prompts + decode_weight * sequences

    def __repr__(self) -> str:
        return f"LoadLedger(requests={self.requests}, prefill_tokens={self.prefill_tokens:g})"
