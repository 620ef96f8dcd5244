"""What an in-process engine says of its load: :class:`LoadMeter`, counted in ``generate``.

The KV router weighs a worker by prompt tokens of prefill it has queued and sequences it
holds (:class:`pipeline.WorkerLoad`). An engine in our process knows both exactly, at the
moment the router asks, if it counts them where requests pass: each request is metered
from its arrival (its prompt tokens still to prefill, as well as the engine can tell then:
a cache lookup, else the whole prompt) through its first output (prefilled: it decodes
now) to its end. The mocker, the llama engine and the vLLM engine count the same way, so
one class; an engine whose scheduler knows better adjusts a request's count when it does.
"""

from __future__ import annotations

from typing import final

import anyio

from pipeline import WorkerLoad

__all__ = ("LoadMeter", "Metered")


@final
class Metered:
    """One request on its way through an engine (see :class:`LoadMeter`)."""

    __slots__ = ("_meter", "done", "prefilling", "tokens")

    def __init__(self, meter: LoadMeter, tokens: int) -> None:
        self._meter = meter
        #: prompt tokens still to prefill, as the engine last knew
        self.tokens = tokens
        #: no output yet
        self.prefilling = True
        self.done = False

    def adjust(self, tokens: int) -> None:
        """It will prefill ``tokens``, now that the engine knows (its cache was looked up)."""
        if self.prefilling:
            self._meter.prefill_tokens += tokens - self.tokens
            self.tokens = tokens

    def prefilled(self) -> None:
        """Its first output is out: it decodes now."""
        if self.prefilling:
            self.prefilling = False
            meter = self._meter
            meter.prefill_tokens -= self.tokens
            meter.waiting -= 1
            meter.decoding += 1

    def close(self) -> None:
        """It ended, however (idempotent)."""
        if self.done:
            return
        self.done = True
        meter = self._meter
        if self.prefilling:
            meter.prefill_tokens -= self.tokens
            meter.waiting -= 1
        else:
            meter.decoding -= 1


@final
class LoadMeter:
    """An engine's requests by where they are: not decoding yet (waiting for a slot, or
    prefilling), decoding."""

    __slots__ = ("decoding", "prefill_tokens", "waiting")

    def __init__(self) -> None:
        #: prompt tokens accepted and not prefilled yet
        self.prefill_tokens = 0
        #: requests past their first output
        self.decoding = 0
        #: requests before their first output
        self.waiting = 0

    def arrived(self, prefill_tokens: int) -> Metered:
        """A request arrived that will prefill ``prefill_tokens`` (as far as is known)."""
        self.prefill_tokens += prefill_tokens
        self.waiting += 1
        return Metered(self, prefill_tokens)

    def report(self, kv_usage: float | None = None) -> WorkerLoad:
        """The load now, as a :class:`pipeline.WorkerLoad` (exact as of this moment)."""
        return WorkerLoad(
            prefill_tokens=max(self.prefill_tokens, 0),
            decoding=self.decoding,
            waiting=self.waiting,
            kv_usage=kv_usage,
            at=anyio.current_time(),
        )

    def __repr__(self) -> str:
        return (
            f"LoadMeter(prefill_tokens={self.prefill_tokens}, decoding={self.decoding}, "
            f"waiting={self.waiting})"
        )
