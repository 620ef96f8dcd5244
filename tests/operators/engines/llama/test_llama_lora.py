"""The llama engine's adapters (LoRA) and priorities, in process: how the scheduler groups
steps by adapter, keys the prefix cache and the KV events by adapter, unloads an adapter
under running requests, and admits waiting requests by priority.

The end-to-end checks (answers equal llama-cpp-python's ``Llama(lora_path=...)``, the
load/unload endpoints) are in ``edges/openai/test_llama_lora_http.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from operators.contracts.llm import (
    EngineOutput,
    PreprocessedRequest,
)
from operators.routing.kv_blocks import adapter_salt, block_hashes, request_block_ids
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import InvalidRequest, KvEvent, KvStored, open_stream
from pipeline.testing import collect, make_context

pytestmark = [pytest.mark.llama, pytest.mark.time_limit(120)]

pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")
pytest.importorskip("gguf", reason="needs the [gguf] extra (make installs it)")

from operators.engines.llama import LlamaEngine, LlamaOptions  # noqa: E402
from operators.engines.llama.lora_file import write_lora_adapter  # noqa: E402

BS = 8
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: write_lora_adapter(find_smollm2_gguf(), folder / f"{name}.gguf", seed=seed)
        for seed, name in enumerate(("tiny", "other"))
    }


@pytest.fixture(scope="module")
def engine(adapters: dict[str, Path]) -> Iterator[LlamaEngine]:
    loras = {"tiny": adapters["tiny"]}
    engine = LlamaEngine(
        options=LlamaOptions(n_ctx=512, n_threads=2, parallel=4, block_size=BS, loras=loras)
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


def ask(
    tokenizer: Tokenizer,
    lora: str | None = None,
    *,
    text: str = PROMPT,
    max_tokens: int = 12,
    priority: int = 0,
) -> PreprocessedRequest:
    """``text`` in ``tokenizer``'s ids, greedy, for exactly ``max_tokens``, with ``lora``."""
    return make_request(
        tokenizer.encode(text),
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        lora=lora,
        priority=priority,
    )


def ids(outputs: list[EngineOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


async def test_each_step_runs_one_adapter_and_the_groups_alternate(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    alone = {
        lora: ids(await collect(engine, make_context(ask(tokenizer, lora))))
        for lora in (None, "tiny")
    }
    assert alone[None] != alone["tiny"]
    before = len(engine.recent_steps())
    together: dict[tuple[str | None, int], list[int]] = {}

    async def one(lora: str | None, i: int) -> None:
        together[lora, i] = ids(await collect(engine, make_context(ask(tokenizer, lora))))

    async with anyio.create_task_group() as tg:
        for i in range(2):
            for lora in (None, "tiny"):
                tg.start_soon(one, lora, i)
    for (lora, _), got in together.items():
        assert got == alone[lora]  # exact beside the other adapter's sequences
    steps = engine.recent_steps()[before:]
    groups = [step.adapter for step in steps]
    assert set(groups) == {None, "tiny"}
    # while both groups had work they took turns: no group ran twice in a row before the
    # other's last step
    last = {group: max(i for i, g in enumerate(groups) if g == group) for group in set(groups)}
    overlap = groups[: min(last.values()) + 1]
    assert all(a != b for a, b in itertools.pairwise(overlap))


async def test_a_prefix_is_reused_only_under_its_own_adapter(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    text = "Tell me about Italy and its old cities, please. " * 3  # no other test's prefix

    async def cached(lora: str | None) -> int | None:
        outputs = await collect(engine, make_context(ask(tokenizer, lora, text=text, max_tokens=2)))
        return outputs[0].cached_tokens

    assert not await cached(None)
    assert not await cached("tiny")  # the base model's cells are no prefix of tiny's
    assert await cached("tiny")
    assert await cached(None)


async def test_kv_events_salt_an_adapters_blocks_as_the_router_does(
    engine: LlamaEngine, tokenizer: Tokenizer
) -> None:
    events: list[KvEvent] = []
    engine.kv_events = events.append
    try:
        text = PROMPT.replace("France", "Spain") * 2
        for lora in ("tiny", None):
            await collect(engine, make_context(ask(tokenizer, lora, text=text, max_tokens=2)))
        snapshot = set(engine.kv_snapshot().block_ids)
    finally:
        engine.kv_events = None
    tokens = tokenizer.encode(text)
    router_ids = request_block_ids(BS)
    salted = router_ids(make_context(ask(tokenizer, "tiny", text=text)))
    plain = router_ids(make_context(ask(tokenizer, None, text=text)))
    assert salted == block_hashes(tokens, BS, parent=adapter_salt("tiny"))
    assert plain == block_hashes(tokens, BS)
    assert not set(salted) & set(plain)
    assert set(salted) <= snapshot
    assert set(plain) <= snapshot
    stored = {block for event in events if isinstance(event, KvStored) for block in event.block_ids}
    assert set(salted) | set(plain) <= stored


async def test_adapters_load_and_unload_under_running_requests(
    engine: LlamaEngine, tokenizer: Tokenizer, adapters: dict[str, Path]
) -> None:
    await engine.load_lora("other", str(adapters["other"]))
    assert dict(engine.loras) == {"tiny": str(adapters["tiny"]), "other": str(adapters["other"])}
    first = ids(await collect(engine, make_context(ask(tokenizer, "other"))))
    long = ask(tokenizer, "other", max_tokens=40)
    async with open_stream(engine, make_context(long)) as stream:
        got = list((await anext(stream)).token_ids)
        await engine.unload_lora("other")  # the running request finishes with it
        assert "other" not in engine.loras
        with pytest.raises(InvalidRequest) as refused:
            await collect(engine, make_context(ask(tokenizer, "other")))
        assert refused.value.param == "model"
        async for output in stream:
            got.extend(output.token_ids)
    assert len(got) == 40
    assert got[: len(first)] == first
    with pytest.raises(KeyError):
        await engine.unload_lora("other")
    await engine.load_lora("other", str(adapters["other"]))  # a name can come back
    assert ids(await collect(engine, make_context(ask(tokenizer, "other")))) == first
    await engine.unload_lora("other")


@pytest.mark.parametrize(
    ("name", "path", "param"),
    [
        ("tiny", "other", "lora_name"),  # taken
        ("x", "missing.gguf", "lora_path"),
        ("x", "broken.gguf", "lora_path"),
    ],
)
async def test_a_load_that_cannot_be_honoured_names_the_field(
    engine: LlamaEngine, adapters: dict[str, Path], name: str, path: str, param: str
) -> None:
    folder = adapters["tiny"].parent
    (folder / "broken.gguf").write_bytes(b"GGUF but not really")
    file = adapters["other"] if path == "other" else folder / path
    with pytest.raises(InvalidRequest) as refused:
        await engine.load_lora(name, str(file))
    assert refused.value.param == param
    assert set(engine.loras) == {"tiny"}


async def test_waiting_requests_are_admitted_by_priority_then_arrival(
    tokenizer: Tokenizer,
) -> None:
    engine = LlamaEngine(options=LlamaOptions(n_ctx=256, n_threads=2, parallel=1))
    try:
        order: list[str] = []

        async def one(name: str, priority: int) -> None:
            context = make_context(ask(tokenizer, priority=priority, max_tokens=2))
            async with open_stream(engine, context) as stream:
                await anext(stream)
                order.append(name)

        async with open_stream(engine, make_context(ask(tokenizer, max_tokens=30))) as running:
            await anext(running)  # it holds the one slot
            async with anyio.create_task_group() as tg:
                for i, (name, priority) in enumerate(
                    (("low-1", 5), ("low-2", 5), ("plain", 0), ("low-3", 5), ("high", -5))
                ):
                    tg.start_soon(one, name, priority)
                    await anyio.wait_all_tasks_blocked()  # it waits for the slot now
                    assert engine.statistics().waiting_sequences == i + 1
                await running.aclose()
        assert order == ["high", "plain", "low-1", "low-2", "low-3"]
    finally:
        engine.close()
