"""The vLLM engine's adapters (LoRA) and priorities on a real vLLM (the CPU build, which
runs LoRA: its punica CPU kernels) and SmolLM2: ``loras={name: PEFT folder}`` maps a
request's ``lora`` to vLLM's ``LoRARequest``, adapters load and unload at run time, and the
engine passes each request's ``priority`` (vLLM's priority scheduling).

The adapter is a PEFT folder the test writes: random rank-8 updates of the first layers'
``q_proj``/``v_proj``, strong enough to change a greedy answer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio

from operators.contracts.llm import PreprocessedRequest
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer
from pipeline import InvalidRequest, open_stream
from pipeline.testing import make_context
from tests.helpers.vllm_support import requires_vllm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.time_limit(180),
]

TOKENIZER = Tokenizer.default()
PROMPT = TOKENIZER.encode(
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
HIDDEN, KV = 576, 192  # SmolLM2-135M: q_proj 576 -> 576, v_proj 576 -> 192


def write_peft_adapter(folder: Path, *, seed: int, rank: int = 8, strength: float = 2.0) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(3):
        for module, n_out in (("q_proj", HIDDEN), ("v_proj", KV)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.standard_normal((rank, HIDDEN)) / np.sqrt(HIDDEN)
            b = rng.standard_normal((n_out, rank)) * (strength / np.sqrt(rank))
            tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {
        name: write_peft_adapter(root / name, seed=i) for i, name in enumerate(("tiny", "other"))
    }


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(adapters: dict[str, Path]) -> AsyncIterator[object]:
    requires_vllm()
    from operators.engines.vllm import VllmEngine

    engine = await anyio.to_thread.run_sync(
        lambda: VllmEngine(max_model_len=512, max_num_seqs=1, loras={"tiny": adapters["tiny"]})
    )
    yield engine
    await engine.aclose()


#: every request here: PROMPT, greedy, eight tokens
request = functools.partial(
    make_request, token_ids=PROMPT, max_tokens=8, ignore_eos=True, temperature=0.0
)


async def answer(engine: object, req: PreprocessedRequest) -> list[int]:
    out: list[int] = []
    async with open_stream(engine, make_context(req)) as stream:  # type: ignore[arg-type]
        async for output in stream:
            out.extend(output.token_ids)
    return out


async def test_a_request_naming_an_adapter_runs_with_it(engine: object) -> None:
    base = await answer(engine, request())
    tiny = await answer(engine, request(lora="tiny"))
    assert tiny != base
    assert await answer(engine, request(lora="tiny")) == tiny  # greedy: the same again
    assert await answer(engine, request()) == base  # and the base model is untouched
    with pytest.raises(InvalidRequest) as refused:
        await answer(engine, request(lora="nope"))
    assert refused.value.param == "model"


async def test_adapters_load_and_unload_at_run_time(
    engine: object, adapters: dict[str, Path]
) -> None:
    from operators.engines.vllm import VllmEngine

    assert isinstance(engine, VllmEngine)
    await engine.load_lora("other", str(adapters["other"]))
    assert set(engine.loras) == {"tiny", "other"}
    other = await answer(engine, request(lora="other"))
    assert other != await answer(engine, request(lora="tiny"))
    await engine.unload_lora("other")
    assert set(engine.loras) == {"tiny"}
    with pytest.raises(InvalidRequest):
        await answer(engine, request(lora="other"))
    with pytest.raises(InvalidRequest) as taken:
        await engine.load_lora("tiny", str(adapters["other"]))
    assert taken.value.param == "lora_name"
    with pytest.raises(InvalidRequest) as missing:
        await engine.load_lora("x", str(adapters["other"].parent / "absent"))
    assert missing.value.param == "lora_path"


async def test_waiting_requests_go_by_priority(engine: object) -> None:
    """One sequence at a time (``max_num_seqs=1``): a high-priority request sent after
    low-priority ones starts before them."""
    order: list[str] = []

    async def one(name: str, priority: int, started: anyio.Event) -> None:
        async with open_stream(
            engine, make_context(request(priority=priority, max_tokens=2))
        ) as stream:  # type: ignore[arg-type]
            started.set()
            await anext(stream)
            order.append(name)

    async with open_stream(engine, make_context(request(max_tokens=60))) as running:  # type: ignore[arg-type]
        await anext(running)
        async with anyio.create_task_group() as tg:
            for name, priority in (("low-1", 5), ("low-2", 5), ("high", -5)):
                started = anyio.Event()
                tg.start_soon(one, name, priority, started)
                await started.wait()
                await anyio.wait_all_tasks_blocked()
            await running.aclose()
    assert order[0] == "high"
