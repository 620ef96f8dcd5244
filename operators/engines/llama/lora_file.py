"""Writing an adapter (LoRA) GGUF for a model: random low-rank updates, for tests and
benchmarks.

A real adapter comes from llama.cpp's ``convert_lora_to_gguf.py`` (a PEFT fine-tune turned
into GGUF); the engine's tests and ``benchmarks/bench_lora.py`` need one for the model
they ship with and no download, so they write one. The layout is llama.cpp's: the
metadata ``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``
and the base model's architecture; per adapted weight ``W`` (``n_out x n_in``) two
tensors ``<W>.lora_a`` (``rank x n_in``) and ``<W>.lora_b`` (``n_out x rank``), so that
the layer computes ``W x + alpha / rank * B (A x)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ("write_lora_adapter",)


def write_lora_adapter(
    model_path: str | Path,
    path: str | Path,
    *,
    rank: int = 8,
    layers: Sequence[int] = (0, 1, 2),
    targets: Sequence[str] = ("attn_q", "attn_v"),
    strength: float = 2.0,
    seed: int = 0,
) -> Path:
    """Write a random adapter of ``model_path`` (a GGUF model) to ``path``: rank
    ``rank`` updates of the ``targets`` weights of ``layers``; ``strength`` scales them
    (2: enough to change a greedy answer of SmolLM2 at once, not to garble it). Needs the
    ``gguf`` and ``numpy`` packages (the ``[gguf]`` and ``[llama]`` extras).

    Raises:
        ValueError: a layer or target the model does not have, or a rank below 1.
    """
    import gguf
    import numpy as np

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    reader = gguf.GGUFReader(str(model_path))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    shapes = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))  # scale alpha/rank = 1
    for layer in layers:
        for target in targets:
            name = f"blk.{layer}.{target}.weight"
            if name not in shapes:
                raise ValueError(f"{model_path} has no tensor {name}")
            n_in, n_out = shapes[name]  # GGUF lists the dimensions innermost first
            a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
            b = rng.standard_normal((n_out, rank)) * (strength / np.sqrt(rank))
            writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
            writer.add_tensor(f"{name}.lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
