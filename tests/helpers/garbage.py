"""What the garbage collector finds, for tests that a request leaves no reference cycles.

A server raises the collector's threshold (:func:`operators.cli.tuning.tune_gc`), so
whatever a request leaves in a cycle stays in memory for thousands of requests; what is
freed by reference counting goes at once.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ("cyclic_garbage",)


@contextmanager
def cyclic_garbage() -> Iterator[Counter[str]]:
    """Collect, then keep the collector off for the block; on exit, the counter holds
    what a collection then found unreachable, by type name (empty: nothing the block
    left was in a cycle). Run what is measured in a function the block calls, so that
    its locals are gone by the end."""
    found: Counter[str] = Counter()
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # (what is unreachable goes to gc.garbage, to name it)
    try:
        yield found
    finally:
        gc.collect()
        found.update(type(thing).__qualname__ for thing in gc.garbage)
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
