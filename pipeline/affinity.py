"""Session affinity: which worker a conversation went to last, for a while.

A client that names its conversation (OpenAI's ``prompt_cache_key``, an
``x-session-affinity`` header) asks for its turns to land where the previous ones did, so
that the worker's cache of the conversation is used even when nothing tells the router
what the worker caches (an engine without KV events), and so that a conversation does not
hop between workers whose costs are nearly equal. The KV router
(:class:`~pipeline.kv_routing.KvRouter`) keeps one :class:`Affinity` and decides whether
the worker's load still allows it.

Bounded twice: an entry lasts ``ttl`` seconds after the conversation's last request, and at
most ``limit`` conversations are remembered (the least recently routed go first), so keys
a client makes up cannot grow the router's memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final, final

__all__ = ("DEFAULT_AFFINITY_LIMIT", "Affinity")

#: conversations remembered at most
DEFAULT_AFFINITY_LIMIT: Final = 100_000


@final
class Affinity:
    """Conversation key -> the worker its last request went to, until ``ttl`` seconds after
    that request. Sans-IO: callers pass the time."""

    __slots__ = ("_entries", "limit", "ttl")

    def __init__(self, ttl: float, limit: int = DEFAULT_AFFINITY_LIMIT) -> None:
        if not ttl >= 0:  # (NaN too)
            raise ValueError(f"the affinity ttl must be >= 0 seconds, got {ttl}")
        if limit < 1:
            raise ValueError(f"the affinity limit must be >= 1, got {limit}")
        #: seconds an entry lasts after its last request (0: affinity is off)
        self.ttl = ttl
        self.limit = limit
        # key -> (worker, expiry), least recently routed first
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def get(self, key: str, now: float) -> str | None:
        """The worker ``key``'s last request went to, unless that is ``ttl`` ago."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        worker, expires = entry
        if expires <= now:
            del self._entries[key]
            return None
        return worker

    def put(self, key: str, worker: str, now: float) -> None:
        """``key``'s request went to ``worker`` at ``now``."""
        if self.ttl == 0:
            return
        entries = self._entries
        entries[key] = (worker, now + self.ttl)
        entries.move_to_end(key)
        while len(entries) > self.limit:
            entries.popitem(last=False)
        # expired entries at the old end go as new ones come: memory follows live keys
        while entries:
            oldest = next(iter(entries.values()))
            if oldest[1] > now:
                break
            entries.popitem(last=False)

    def forget(self, worker: str) -> None:
        """Drop every conversation on ``worker`` (it left)."""
        for key in [key for key, (held, _) in self._entries.items() if held == worker]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Affinity(ttl={self.ttl:g}s, {len(self._entries)} conversations)"
