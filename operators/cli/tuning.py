"""Process settings for a long-running server or worker: the garbage collector and the GIL
switch interval, tuned once at start-up (measured in docs/design.md, "The hot path")."""

from __future__ import annotations

import gc
import sys
from typing import Final

__all__ = ("tune_gc", "tune_threads")

#: young objects between collections (CPython's default is 700)
_GC_YOUNG_THRESHOLD: Final = 50_000
#: seconds a thread may hold the GIL while another waits for it (CPython's default: 0.005)
_SWITCH_INTERVAL: Final = 0.001


def tune_gc() -> None:
    """Keep the garbage collector off the per-token path of a long-running server.

    Every token allocates a few short-lived objects, so the default threshold runs a young
    collection every few dozen tokens, and each full collection walks every object alive,
    the tokenizer's tables and all imported modules included, more of them the more
    streams are in flight. What is loaded at start-up lives as long as the process:
    ``gc.freeze()`` takes it out of every later collection. Collecting young objects ~70
    times less often costs memory only for what is left in reference cycles, freed by
    nothing but a collection: a request leaves none (the task beside a response ends
    through a scope of its own, a leg's controller is held weakly by its parent, a first
    span is not its own root; ``tests/operators/edges/http/test_cyclic_garbage.py``). A
    request that left ~17 objects in cycles (~2.7 KiB) kept them until each collection,
    every ~2,700 requests: ~8 MiB more resident memory than needed.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def tune_threads() -> None:
    """Give the event loop the GIL back within 1 ms when a worker thread holds it.

    A large prompt is rendered and encoded in a worker thread
    (:class:`~operators.edges.openai.preprocessor.OpenAIPreprocessor`); while it runs, every time
    the loop wants the GIL it waits up to the switch interval, and a small request takes
    several loop turns. At the default 5 ms a 20 MB prompt added ~50 ms to every other
    request; with nothing else running in threads the interval costs nothing.
    """
    sys.setswitchinterval(_SWITCH_INTERVAL)
