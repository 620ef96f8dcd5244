"""One model's adapters (LoRA) over several engines: what a model served by in-process
workers (``serve --engine llama --decode-workers N``, prefill workers) loads and unloads.

Every worker of the model must hold every adapter, so that the KV router may send a
request naming one to any of them (to the one holding that adapter's prefix, by the
salted block ids: :func:`~operators.routing.kv_blocks.adapter_salt`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import final

from .llm import LoraEngine

__all__ = ("EveryWorker",)


@final
class EveryWorker:
    """A :class:`~operators.contracts.llm.LoraEngine` loading into and unloading from every
    one of ``engines`` (their adapters: the first's, which all share)."""

    def __init__(self, engines: Sequence[LoraEngine]) -> None:
        if not engines:
            raise ValueError("EveryWorker needs at least one engine")
        self._engines = list(engines)

    @property
    def loras(self) -> Mapping[str, str]:
        return self._engines[0].loras

    async def load_lora(self, name: str, path: str, /) -> None:
        """Load into each engine; if one refuses, the others forget it again."""
        done: list[LoraEngine] = []
        try:
            for engine in self._engines:
                await engine.load_lora(name, path)
                done.append(engine)
        except BaseException:
            for engine in done:
                await engine.unload_lora(name)
            raise

    async def unload_lora(self, name: str, /) -> None:
        missing = 0
        for engine in self._engines:
            try:
                await engine.unload_lora(name)
            except KeyError:
                missing += 1
        if missing == len(self._engines):
            raise KeyError(name)
