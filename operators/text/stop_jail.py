"""Withhold text that might still turn into a stop string, for one output choice.

Why this module exists: streamed decoding releases text before the model has finished
writing it, so a stop string split across tokens (``" zeta" + " eta" + " theta"``) leaks
every fragment but the last unless the partial match is withheld. The bug classes this
module closes (``docs/bug-classes.md``):

* B1 -- a split hidden stop string leaks: we withhold every viable prefix.
* B3 -- withheld text is reordered: released text is always a prefix of the stream.
* B12 -- quadratic stop matching: an Aho-Corasick automaton makes the per-push cost
  O(len(text)) amortized, independent of the output so far and of the stop lengths.
* B13 -- list order wins instead of the earliest match: the stop that *completes* first
  wins; ties at the same end go to the longest stop.
* B16 -- empty leading chunks from a fixed holdback: we withhold exactly the longest tail
  that is still a proper prefix of some stop, and nothing when no prefix is viable.

It is sans-IO: no event loop, no I/O, so the Backend operator adapts it to a stream and the
tests drive it synchronously.

Two layers:

* `StopMatcher` is the compiled automaton, a pure function of the stop set. It is immutable
  and cached by `StopMatcher.compile`, so every request with the same stops shares one.
* `StopJail` is the per-choice mutable state: the automaton state id, and whether a stop
  has fired. The withheld text is not stored: it is always the last ``depth`` characters of
  the stream, which equal the first ``depth`` characters of any stop string passing through
  the current state, so it is sliced out of that stop string on demand. Nothing of the
  history is kept, and producing text costs only as much as the text produced.

`find_stop` is the deliberately naive reference (``str.find``) that tests compare against.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NoReturn, final

__all__ = ("Released", "StopJail", "StopMatcher", "Stopped", "find_stop")

_COMPILE_CACHE_SIZE: Final = 1024
_EMPTY_GOTO: Final[dict[str, int]] = {}  # shared by all leaf states; never mutated


@dataclass(slots=True)
class Released:
    """No stop yet: `text` may be shown to the client now (it may be ``""``)."""

    text: str


@dataclass(slots=True)
class Stopped:
    """A stop string matched; the choice is finished.

    `text` is the last text to release: everything not yet released up to the cut (the
    match start when the stop is hidden, the match end when it is visible). Text after the
    match is discarded.
    """

    text: str
    stop: str


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """Return ``(start, end, stop)`` of the match that ends first in `text`, or None.

    Among stops that complete at the same end position the longest (earliest start) wins.
    Empty stops are ignored. This is the offline reference for `StopJail`: simple, not fast.
    """
    best: tuple[int, int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        start = text.find(stop)  # first occurrence == earliest end, for a fixed length
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or end < best[1] or (end == best[1] and start < best[0]):
            best = (start, end, stop)
    return best


def _normalize(stops: Iterable[str]) -> tuple[str, ...]:
    if isinstance(stops, str):
        # A bare string would iterate as one-character stops: a caller bug, not a stop set.
        raise TypeError("stops must be an iterable of strings, not a single str")
    unique: set[str] = set()
    for stop in stops:
        if not isinstance(stop, str):
            raise TypeError(f"stop strings must be str, got {type(stop).__name__}")
        if stop:
            unique.add(stop)
    return tuple(sorted(unique))


@final
class StopMatcher:
    """An Aho-Corasick automaton over a set of stop strings. Immutable; share it freely.

    State 0 is the root. For every state the tables hold: its goto transitions, its failure
    link, its depth (the length of the stream tail it stands for, i.e. the withhold
    length), one stop string that passes through it (its first `depth` characters *are*
    that tail), and the longest stop string ending at it via the dictionary-suffix chain
    (``""`` when none), so a match check is O(1) per character.

    Use `StopMatcher.compile`, which caches; the constructor always builds.
    """

    __slots__ = ("_depth", "_fail", "_goto", "_out", "_out_len", "_path", "_root_chars", "stops")

    stops: tuple[str, ...]
    _goto: tuple[dict[str, int], ...]
    _fail: tuple[int, ...]
    _depth: tuple[int, ...]
    _path: tuple[str, ...]
    _out: tuple[str, ...]
    _out_len: tuple[int, ...]
    _root_chars: frozenset[str]

    def __init__(self, stops: Iterable[str]) -> None:
        normalized = _normalize(stops)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        path = [""]
        terminal = [""]
        for stop in normalized:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    path.append(stop)
                    terminal.append("")
                state = nxt
            terminal[state] = stop

        # Breadth-first, so a state's failure target (shallower) is finished before it.
        fail = [0] * len(goto)
        out = list(terminal)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in goto[state].items():
                target = fail[state]
                while target and ch not in goto[target]:
                    target = fail[target]
                # Root children keep link 0; `child` is deeper, so `link` is never `child`.
                link = goto[target].get(ch, 0)
                fail[child] = link
                if not out[child]:
                    out[child] = out[link]
                queue.append(child)

        set_ = object.__setattr__
        set_(self, "stops", normalized)
        set_(self, "_goto", tuple(g if g else _EMPTY_GOTO for g in goto))
        set_(self, "_fail", tuple(fail))
        set_(self, "_depth", tuple(depth))
        set_(self, "_path", tuple(path))
        set_(self, "_out", tuple(out))
        set_(self, "_out_len", tuple(len(s) for s in out))
        set_(self, "_root_chars", frozenset(goto[0]))

    @classmethod
    def compile(cls, stops: tuple[str, ...]) -> StopMatcher:
        """Return the shared matcher for `stops` (order, duplicates and ``""`` don't matter)."""
        return _compile(_normalize(stops))

    @property
    def max_len(self) -> int:
        """Length of the longest stop string (0 when there are none)."""
        return max(map(len, self.stops), default=0)

    @property
    def state_count(self) -> int:
        """Number of automaton states, root included."""
        return len(self._goto)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"StopMatcher is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"StopMatcher is immutable (cannot delete {name!r})")

    def __repr__(self) -> str:
        return f"StopMatcher(stops={self.stops!r})"


@functools.lru_cache(maxsize=_COMPILE_CACHE_SIZE)
def _compile(normalized: tuple[str, ...]) -> StopMatcher:
    # Bounded: stop lists come from clients, so an unbounded cache would be a memory leak.
    return StopMatcher(normalized)


@final
class StopJail:
    """Stop-string matching for one output choice: feed decoded text, get what to release.

    `push` returns `Released` with the text the client may see now, or `Stopped` once a stop
    string completes. The match rule does not depend on how the text is cut into pushes:
    the stop fires at the earliest end position where any stop completes; among stops
    ending there, the longest wins. Hidden stops (the default) cut at the match start;
    with ``include_stop_in_output=True`` the cut is at the match end.

    `flush` ends the stream without a stop and returns the withheld text. The jail may be
    pushed to again afterwards; matching restarts, since flushed text was released and can
    no longer be part of a stop.
    """

    __slots__ = ("_active", "_include", "_matcher", "_state", "_stopped")

    def __init__(self, stops: Iterable[str], *, include_stop_in_output: bool = False) -> None:
        self._matcher = _compile(_normalize(stops))  # == StopMatcher.compile, one normalize
        self._active = bool(self._matcher.stops)
        self._include = include_stop_in_output
        self._state = 0
        self._stopped = False

    @property
    def matcher(self) -> StopMatcher:
        """The shared compiled automaton."""
        return self._matcher

    @property
    def include_stop_in_output(self) -> bool:
        return self._include

    @property
    def active(self) -> bool:
        """False when there is no stop string: every push releases its text whole."""
        return self._active

    @property
    def stopped(self) -> bool:
        """True once `push` has returned `Stopped`."""
        return self._stopped

    @property
    def withheld(self) -> str:
        """The text held back right now: the longest tail that is a proper stop prefix."""
        m = self._matcher
        return m._path[self._state][: m._depth[self._state]]

    def push(self, text: str) -> Released | Stopped:
        """Feed newly decoded text. Raises RuntimeError once a stop has matched."""
        if self._stopped:
            raise RuntimeError("StopJail.push() after a stop string matched: the choice is done")
        state = self._state
        if not self._active:
            return Released(text)
        m = self._matcher
        if state == 0 and m._root_chars.isdisjoint(text):
            return Released(text)  # no character can even start a stop

        goto = m._goto
        fail = m._fail
        out_len = m._out_len
        start_state = state
        for i, ch in enumerate(text):
            nxt = goto[state].get(ch)
            while nxt is None and state:
                state = fail[state]
                nxt = goto[state].get(ch)
            state = 0 if nxt is None else nxt
            if out_len[state]:
                return self._stop(start_state, text, i + 1, state)

        self._state = state
        # The new tail (depth of `state`) lies within withheld + text; release the rest.
        released = m._depth[start_state] + len(text) - m._depth[state]
        return Released(self._take(start_state, text, released))

    def flush(self) -> str:
        """End of stream without a stop: return and clear the withheld text."""
        text = self.withheld
        self._state = 0
        return text

    def _stop(self, start_state: int, text: str, consumed: int, state: int) -> Stopped:
        m = self._matcher
        end = m._depth[start_state] + consumed  # in withheld + text coordinates
        cut = end if self._include else end - m._out_len[state]
        self._stopped = True
        self._state = 0
        return Stopped(self._take(start_state, text, cut), m._out[state])

    def _take(self, start_state: int, text: str, n: int) -> str:
        """The first `n` characters of ``withheld + text``, where withheld is `start_state`'s."""
        m = self._matcher
        held = m._depth[start_state]
        if not held:
            return text[:n]
        path = m._path[start_state]
        if n <= held:
            return path[:n]
        return path[:held] + text[: n - held]
