"""Adapters (LoRA) in vLLM: our names to vLLM's ``LoRARequest`` s, and its engine arguments.

vLLM runs a request with an adapter when it comes with a ``LoRARequest(name, int id,
path)``; an adapter is a PEFT folder (``adapter_config.json`` and the weights). vLLM needs
LoRA switched on when it starts (``enable_lora``), with the largest rank it will meet
(``max_lora_rank``: the adapters' own ``r``, rounded up to a size vLLM takes) and how many
adapters one batch may mix (``max_loras``); so a :class:`~.engine.VllmEngine` runs
adapters only when it was created with some (``--lora NAME=DIR``), and then also takes
more at run time (their rank at most the largest it started with).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, final

from pipeline import InvalidRequest

__all__ = ("VllmAdapters", "lora_args")

#: the ranks vLLM takes for ``max_lora_rank``
_RANKS: Final = (8, 16, 32, 64, 128, 256, 320, 512)


def _rank_of(folder: Path) -> int:
    """The adapter's rank (``r`` in its ``adapter_config.json``).

    Raises:
        InvalidRequest: no PEFT adapter folder at ``folder`` (naming ``lora_path``).
    """
    config = folder / "adapter_config.json"
    try:
        rank = json.loads(config.read_text(encoding="utf-8"))["r"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(
            f"{folder} is no PEFT adapter folder (its adapter_config.json: {exc})",
            param="lora_path",
        ) from exc
    if not isinstance(rank, int) or rank < 1:
        raise InvalidRequest(f"{config}: 'r' must be a positive integer", param="lora_path")
    return rank


def lora_args(loras: Mapping[str, Path]) -> dict[str, Any]:
    """vLLM's engine arguments for serving ``loras`` (and more of no larger rank later).

    Raises:
        InvalidRequest: an adapter folder cannot be read, or its rank is above vLLM's most.
    """
    largest = max(_rank_of(Path(path)) for path in loras.values())
    rank = next((size for size in _RANKS if size >= largest), None)
    if rank is None:
        raise InvalidRequest(f"an adapter of rank {largest} is above vLLM's {_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": max(2, len(loras))}


@final
class VllmAdapters:
    """The adapters a vLLM engine runs, by our names (a live mapping: name -> folder)."""

    __slots__ = ("_counter", "_ids", "_rank", "paths")

    def __init__(self, loras: Mapping[str, Path], *, max_rank: int) -> None:
        self._ids: dict[str, int] = {}
        self._rank = max_rank
        #: name -> where from, as the engine's ``loras`` shows it
        self.paths: dict[str, str] = {}
        self._counter = itertools.count(1)
        for name, path in loras.items():
            self.add(name, Path(path))

    def add(self, name: str, path: Path) -> None:
        """Know ``name`` as the adapter in folder ``path``.

        Raises:
            InvalidRequest: the name is taken, the folder is no adapter, or its rank is
                above the engine's (naming ``lora_name`` or ``lora_path``).
        """
        if name in self.paths:
            raise InvalidRequest(f"an adapter named {name!r} is loaded", param="lora_name")
        rank = _rank_of(path)
        if rank > self._rank:
            raise InvalidRequest(
                f"the adapter's rank {rank} is above this engine's most ({self._rank}; "
                "start it with an adapter of that rank)",
                param="lora_path",
            )
        self._ids[name] = next(self._counter)
        self.paths[name] = str(path)

    def remove(self, name: str) -> int:
        """Forget ``name``; vLLM's id for it.

        Raises:
            KeyError: no such adapter.
        """
        del self.paths[name]
        return self._ids.pop(name)

    def request(self, name: str, request_id: str) -> Any:
        """vLLM's ``LoRARequest`` for ``name``.

        Raises:
            InvalidRequest: no adapter of that name is loaded (naming ``model``).
        """
        from vllm.lora.request import LoRARequest

        lora_id = self._ids.get(name)
        if lora_id is None:
            raise InvalidRequest(
                f"no adapter {name!r} is loaded", param="model", request_id=request_id
            )
        return LoRARequest(name, lora_id, self.paths[name])
