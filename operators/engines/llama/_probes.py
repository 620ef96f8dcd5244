"""What this llama.cpp build and model can be trusted with, probed once when the engine
loads (in the scheduler's thread, before its first step; each probe clears the cache).

- :func:`batch_invariant`: whether a token's logits are the same bits whatever else is in
  its batch. Only then is batched output identical to one-at-a-time output (the engine
  warns otherwise: a build with ``GGML_LLAMAFILE=ON`` is not).
- :func:`kv_layout`: whether a sequence's cells survive an export and a load exactly, and
  if so their layout. Only then does the engine move KV between slots, tiers and workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._kv_cells import KvFormatError
from ._runtime import Feed, LlamaFailure

try:
    import numpy as np
except ImportError:  # the [llama] extra is missing: LlamaEngine() says so before any use
    pass

if TYPE_CHECKING:
    from ._kv_cells import KvLayout
    from ._runtime import Runtime

__all__ = ("batch_invariant", "kv_layout")


def kv_layout(runtime: Runtime) -> KvLayout | None:
    """The layout of the model's cells if they survive an export and a load exactly (the
    logits after a loaded copy are the same bits as after the original, on a 24-token
    probe); None if not."""
    probe = [(13 * i + 200) % runtime.n_vocab for i in range(24)]
    runtime.clear()
    try:
        runtime.fill(0, probe[:-1])
        cells = runtime.export(0)
        runtime.decode([Feed(0, probe[-1:], 1)])
        original = runtime.row(0).copy()
        target = 1 if runtime.parallel > 1 else 0
        runtime.load(target, cells, probe[:-1])
        runtime.decode([Feed(target, probe[-1:], 1)])
        return cells.layout if np.array_equal(original, runtime.row(0)) else None
    except (KvFormatError, LlamaFailure):
        return None
    finally:
        runtime.clear()


def batch_invariant(runtime: Runtime) -> bool:
    """Whether a token's logits are the same bits alone, at the end of a burst of its own
    sequence (speculative verification), and beside other sequences' tokens (checked on a
    24-token probe).

    Raises:
        LlamaFailure: llama.cpp failed on the probe.
    """
    probe = [(7 * i + 100) % runtime.n_vocab for i in range(24)]
    other = [(11 * i + 300) % runtime.n_vocab for i in range(16)]
    runtime.clear()
    runtime.fill(0, probe[:-1])
    runtime.decode([Feed(0, probe[-1:], 1)])
    alone = runtime.row(0).copy()
    runtime.keep(0, len(probe) - 2)
    runtime.decode([Feed(0, probe[-2:], 2)])
    same = bool(np.array_equal(alone, runtime.row(1)))
    if runtime.parallel > 1:
        runtime.fill(1, other[:8])
        for beside in (other[8:9], other[9:]):  # another decode, then a prompt chunk
            runtime.keep(0, len(probe) - 1)
            offsets = runtime.decode([Feed(0, probe[-1:], 1), Feed(1, beside, 1)])
            same = same and bool(np.array_equal(alone, runtime.row(offsets[0])))
    runtime.clear()
    return same
