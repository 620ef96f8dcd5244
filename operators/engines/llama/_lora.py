"""Adapters (LoRA) in the llama engine: what a loaded one is, and the engine's adapters by
name.

llama.cpp applies adapters to a whole context (``llama_set_adapters_lora``), not per
sequence, so one step can only run the sequences of one adapter (or of the base model).
The scheduler groups them: each step takes one group's decoding and prefilling
sequences, and the groups take turns (:func:`~._plan.next_group`: the one that waited
longest), so an adapter with one request is not starved by a busy base model, and the base
model's answers pause only while another group steps.

A slot's cells were computed under one adapter (``attn_v`` updates change the values
cached), so a prefix is reused only by a sequence of the same adapter: the scheduler
records whose cells each slot holds, and the KV events salt the slot's block ids with
the adapter's name (:func:`~operators.routing.kv_blocks.adapter_salt`), as the KV router
does for a request naming it. The KV tiers keep base-model blocks only.

Loading and freeing run in the thread that owns llama.cpp (the scheduler's), between two
steps: :class:`Adapters` is handed that thread as a :class:`LlamaThread`, the two things
it asks of it, and knows nothing else of the scheduler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, final

import anyio

from operators.routing.kv_blocks import adapter_salt
from pipeline import EngineError, InvalidRequest

from ._runtime import LlamaFailure

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ("Adapter", "Adapters", "LlamaThread")


@final
class Adapter:
    """One adapter loaded in the runtime. Compared by identity: an adapter unloaded and
    loaded again under its name is another one, and reuses none of the first's cells."""

    __slots__ = ("freed", "handle", "name", "path", "salt")

    def __init__(self, name: str, path: str, handle: object) -> None:
        self.name = name
        self.path = path
        #: llama.cpp's ``llama_adapter_lora *``
        self.handle = handle
        #: the parent id of its prompts' first block (the KV events' and the router's)
        self.salt = adapter_salt(name)
        #: set by the scheduler thread once llama.cpp freed it
        self.freed = False

    def __repr__(self) -> str:
        return f"Adapter({self.name!r}, {self.path!r})"


class LlamaThread(Protocol):
    """What :class:`Adapters` needs of the thread that owns llama.cpp (the scheduler)."""

    def call(self, work: Callable[[], object]) -> Future[object]:
        """Run ``work`` in that thread between two steps; its result in the future."""
        ...

    def retire(self, adapter: Adapter) -> None:
        """Free ``adapter`` once no request runs with it."""
        ...


@final
class Adapters:
    """The engine's adapters by name (the request tasks' side): loads them in ``thread``,
    hands them to requests, and has ``thread`` free them."""

    __slots__ = ("_by_name", "_thread", "paths")

    def __init__(self, thread: LlamaThread) -> None:
        self._thread = thread
        self._by_name: dict[str, Adapter] = {}
        #: name -> the file it was loaded from (the engine's ``loras``, a live view)
        self.paths: dict[str, str] = {}

    def _add(self, name: str, path: str, handle: object) -> None:
        self._by_name[name] = Adapter(name, path, handle)
        self.paths[name] = path

    def load_now(self, runtime: Runtime, name: str, path: str) -> None:
        """Load an adapter before the scheduler runs any step (at the engine's start).

        Raises:
            ValueError: the name is taken, or llama.cpp refused the file.
        """
        if name in self._by_name:
            raise ValueError(f"two adapters are named {name!r}")
        try:
            self._add(name, path, runtime.load_adapter(path))
        except LlamaFailure as exc:
            raise ValueError(str(exc)) from exc

    async def load(self, runtime: Runtime, name: str, path: str) -> None:
        """Load the adapter GGUF at ``path`` as ``name``, between two steps.

        Raises:
            InvalidRequest: the name is taken, or no adapter of this model is at ``path``
                (naming ``lora_name`` or ``lora_path``).
            EngineError: the engine is closed.
        """
        if name in self._by_name:
            raise InvalidRequest(f"an adapter named {name!r} is loaded", param="lora_name")

        def load() -> object:
            if not Path(path).is_file():
                raise InvalidRequest(f"no adapter file at {path!r}", param="lora_path")
            return runtime.load_adapter(path)

        future = self._thread.call(load)
        try:
            handle = await anyio.to_thread.run_sync(future.result)
        except LlamaFailure as exc:
            raise InvalidRequest(str(exc), param="lora_path") from exc
        if name in self._by_name:  # loaded meanwhile by another call
            self._thread.retire(Adapter(name, path, handle))
            raise InvalidRequest(f"an adapter named {name!r} is loaded", param="lora_name")
        self._add(name, path, handle)

    def unload(self, name: str) -> None:
        """Forget ``name`` now (new requests cannot name it); llama.cpp frees it once its
        running requests are done.

        Raises:
            KeyError: no adapter of that name.
        """
        adapter = self._by_name.pop(name)
        del self.paths[name]
        with contextlib.suppress(EngineError):  # closed: freed with the model
            self._thread.retire(adapter)

    def get(self, name: str | None, request_id: str) -> Adapter | None:
        """The adapter a request names (None: none, the base model).

        Raises:
            InvalidRequest: no adapter of that name is loaded (naming ``model``).
        """
        if name is None:
            return None
        adapter = self._by_name.get(name)
        if adapter is None:
            raise InvalidRequest(
                f"no adapter {name!r} is loaded", param="model", request_id=request_id
            )
        return adapter
