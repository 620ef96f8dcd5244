"""LoRA adapters on the llama engine, driven as a user would: ``serve --engine llama --lora
tiny=PATH`` as a subprocess, the official ``openai`` client, and llama-cpp-python's own
``Llama(lora_path=...)`` as the reference.

The adapter is written by the test (``write_lora_adapter``: random rank-8 updates of the
first layers' ``attn_q``/``attn_v``), strong enough that its greedy answers differ from
the base model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.helpers.server_process import ServerProcess, run_cli

pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.time_limit(180)]

llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [llama] extra (make installs it)")
pytest.importorskip("gguf", reason="needs the [gguf] extra (make installs it)")

from operators.engines.llama.lora_file import write_lora_adapter  # noqa: E402
from operators.text.tokenizer import find_smollm2_gguf  # noqa: E402

KEY = "lora-key"
BASE = "smollm2"
PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n",
)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adapters")
    write_lora_adapter(find_smollm2_gguf(), folder / "tiny.gguf", seed=0)
    write_lora_adapter(find_smollm2_gguf(), folder / "other.gguf", seed=1)
    (folder / "broken.gguf").write_bytes(b"not a gguf file")
    return folder


def reference(lora_path: Path | None) -> list[str]:
    """llama-cpp-python's greedy answers to PROMPTS (with the adapter at ``lora_path``)."""
    options: dict[str, Any] = {} if lora_path is None else {"lora_path": str(lora_path)}
    model = llama_cpp.Llama(str(find_smollm2_gguf()), n_ctx=512, verbose=False, **options)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    eog = {t for t in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    answers = []
    for prompt in PROMPTS:
        tokens = model.tokenize(prompt.encode(), add_bos=False, special=True)
        out: list[int] = []
        for token in model.generate(tokens, top_k=1, temp=0.0, reset=True):
            if token in eog:
                break
            out.append(token)
            if len(out) == MAX_TOKENS:
                break
        answers.append(model.detokenize(out).decode())
    model.close()
    return answers


@pytest.fixture(scope="module")
def expected(lora_dir: Path) -> dict[str, list[str]]:
    return {
        BASE: reference(None),
        "tiny": reference(lora_dir / "tiny.gguf"),
        "other": reference(lora_dir / "other.gguf"),
    }


@pytest.fixture(scope="module")
def server(lora_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        "--engine", "llama", "--model-name", BASE, "--parallel", "4", "--n-ctx", "512",
        "--lora", f"tiny={lora_dir / 'tiny.gguf'}", "--lora-dir", str(lora_dir),
        "--api-key", KEY,
        startup_timeout=60,
    )  # fmt: skip
    yield process
    process.stop()
    assert "Traceback" not in process.stderr()


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


async def complete(api: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    reply = await api.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    return reply.choices[0].text


def post(server: ServerProcess, path: str, body: dict[str, Any], key: str | None = KEY) -> Any:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/{path}", json=body, headers=headers, timeout=30)


def test_the_adapter_changes_the_answers(expected: dict[str, list[str]]) -> None:
    assert expected["tiny"] != expected[BASE]  # else the tests below could not fail
    assert expected["other"] != expected["tiny"]


async def test_adapter_and_base_answers_equal_llama_cpp_s_own(
    server: ServerProcess, expected: dict[str, list[str]]
) -> None:
    async with client(server) as api:
        for model in ("tiny", BASE):
            got = [await complete(api, model, prompt) for prompt in PROMPTS]
            assert got == expected[model], model


async def test_interleaved_requests_for_adapter_and_base_stay_exact(
    server: ServerProcess, expected: dict[str, list[str]]
) -> None:
    got: dict[tuple[str, int], str] = {}
    async with client(server) as api:

        async def one(model: str, index: int) -> None:
            got[model, index] = await complete(api, model, PROMPTS[index])

        async with anyio.create_task_group() as tg:
            for round_ in range(2):
                for index in range(len(PROMPTS)):
                    tg.start_soon(one, (BASE, "tiny")[(index + round_) % 2], index)
                    tg.start_soon(one, (BASE, "tiny")[(index + round_ + 1) % 2], index)
    assert len(got) == 2 * len(PROMPTS)
    for (model, index), text in got.items():
        assert text == expected[model][index], (model, index)


async def test_the_adapter_is_listed_as_a_model_whose_parent_is_the_base(
    server: ServerProcess, lora_dir: Path
) -> None:
    async with client(server) as api:
        listed = {model.id: model for model in (await api.models.list()).data}
        tiny = await api.models.retrieve("tiny")
    assert set(listed) >= {BASE, "tiny"}
    card: Any = tiny
    assert card.parent == BASE
    assert Path(card.root) == (lora_dir / "tiny.gguf").resolve()
    assert getattr(listed[BASE], "parent", None) is None


async def test_adapters_load_and_unload_at_run_time(
    server: ServerProcess, lora_dir: Path, expected: dict[str, list[str]]
) -> None:
    loaded = post(
        server,
        "load_lora_adapter",
        {"lora_name": "other", "lora_path": str(lora_dir / "other.gguf")},
    )
    assert loaded.status_code == 200, loaded.text
    async with client(server) as api:
        assert "other" in [model.id for model in (await api.models.list()).data]
        assert await complete(api, "other", PROMPTS[0]) == expected["other"][0]
        assert await complete(api, "tiny", PROMPTS[0]) == expected["tiny"][0]  # untouched
        unloaded = post(server, "unload_lora_adapter", {"lora_name": "other"})
        assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError) as gone:
            await complete(api, "other", PROMPTS[0])
        body: Any = gone.value.body
        assert (body["code"], body["param"]) == ("model_not_found", "model")
        assert "other" not in [model.id for model in (await api.models.list()).data]
        again = post(server, "unload_lora_adapter", {"lora_name": "other"})
        assert again.status_code == 404
        assert again.json()["error"]["param"] == "lora_name"
        # loaded again under the same name, it answers as before
        reloaded = post(
            server,
            "load_lora_adapter",
            {"lora_name": "other", "lora_path": str(lora_dir / "other.gguf")},
        )
        assert reloaded.status_code == 200, reloaded.text
        assert await complete(api, "other", PROMPTS[1]) == expected["other"][1]
        assert post(server, "unload_lora_adapter", {"lora_name": "other"}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"lora_name": "x", "lora_path": "/etc/hostname"}, 400, "lora_path"),  # outside --lora-dir
        ({"lora_name": "x", "lora_path": "{dir}/../tiny.gguf"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": "{dir}/missing.gguf"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": "{dir}/broken.gguf"}, 400, "lora_path"),  # no GGUF
        ({"lora_name": "tiny", "lora_path": "{dir}/other.gguf"}, 400, "lora_name"),  # taken
        ({"lora_name": BASE, "lora_path": "{dir}/other.gguf"}, 400, "lora_name"),
        ({"lora_path": "{dir}/other.gguf"}, 400, "lora_name"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ],
)
def test_a_load_that_cannot_be_honoured_is_a_400_naming_the_field(
    server: ServerProcess, lora_dir: Path, body: dict[str, str], status: int, param: str
) -> None:
    body = {key: value.replace("{dir}", str(lora_dir)) for key, value in body.items()}
    reply = post(server, "load_lora_adapter", body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
    assert "x" not in [model["id"] for model in httpx.get(
        f"{server.base_url}/models", headers={"authorization": f"Bearer {KEY}"}, timeout=5
    ).json()["data"]]  # fmt: skip


def test_loading_and_unloading_need_the_api_key(server: ServerProcess, lora_dir: Path) -> None:
    body = {"lora_name": "y", "lora_path": str(lora_dir / "other.gguf")}
    assert post(server, "load_lora_adapter", body, key=None).status_code == 401
    assert post(server, "load_lora_adapter", body, key="wrong").status_code == 401
    assert post(server, "unload_lora_adapter", {"lora_name": "tiny"}, key=None).status_code == 401


async def test_the_kv_router_keeps_each_adapters_prefix_apart(
    lora_dir: Path, expected: dict[str, list[str]]
) -> None:
    """Two in-process workers behind ``--router kv``: a prompt cached under the adapter is
    found again under it (routed to its holder) and never under the base model."""
    server = ServerProcess(
        "--engine", "llama", "--model-name", BASE, "--decode-workers", "2", "--router", "kv",
        "--n-ctx", "512", "--lora", f"tiny={lora_dir / 'tiny.gguf'}",
        startup_timeout=60,
    )  # fmt: skip
    prompt = PROMPTS[0] * 3  # long enough for several blocks
    try:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="x", max_retries=0, timeout=60
        ) as api:

            async def cached(model: str, text: str = prompt) -> int:
                reply = await api.completions.create(
                    model=model, prompt=text, max_tokens=2, temperature=0
                )
                assert reply.usage is not None
                details = reply.usage.prompt_tokens_details
                return 0 if details is None else details.cached_tokens or 0

            assert await cached("tiny") == 0
            assert await cached("tiny") > 0  # the worker holding tiny's prefix
            assert await cached(BASE) == 0  # the same tokens, another model's cells
            assert await cached(BASE) > 0
            # loaded at run time, an adapter is loaded in every worker
            body = {"lora_name": "other", "lora_path": str(lora_dir / "other.gguf")}
            loaded = post(server, "load_lora_adapter", body, key=None)
            assert loaded.status_code == 200, loaded.text
            for _ in range(2):
                answer = await api.completions.create(
                    model="other", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
                )
                assert answer.choices[0].text == expected["other"][0]
    finally:
        server.stop()
    assert "Traceback" not in server.stderr()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "--engine", "echo", "--lora", "tiny=a.gguf"], "--lora needs --engine llama"),
        (["serve", "--engine", "llama", "--lora", "tiny"], "expected NAME=PATH"),
        (["serve", "--nats", "nats://h:4222", "--lora", "t=a.gguf"], "served in process only"),
        (
            ["worker", "--nats", "nats://h:4222", "--engine", "llama", "--lora", "t=a.gguf"],
            "served in process only",
        ),
    ],
)
def test_lora_option_mistakes_are_usage_errors(argv: list[str], said: str) -> None:
    result = run_cli(argv)
    assert result.returncode == 2
    assert said in result.stderr
    assert "Traceback" not in result.stderr


def test_an_adapter_file_the_engine_cannot_load_stops_serve_with_one_line(lora_dir: Path) -> None:
    result = run_cli(
        ["serve", "--engine", "llama", "--port", "0", "--lora", f"x={lora_dir / 'broken.gguf'}"]
    )
    assert result.returncode == 1
    assert "broken.gguf" in result.stderr
    assert "Traceback" not in result.stderr
