"""The module paths ``operators`` had before its modules were grouped by kind, still importable.

Why: users, examples and other projects import ``operators.stop_jail``,
``operators.openai.server``, ``operators.llm``... Grouping the package into ``edges/``,
``text/``, ``routing/`` and ``contracts/`` must not break them, and an old path must give
the *same* module object as the new one: a second copy would define a second
``PreprocessedRequest`` class, and ``isinstance`` would then fail across the two names.

So the old names are aliases, not files: :class:`MovedModuleFinder` sits first on
``sys.meta_path`` and answers for every name under a moved prefix (the package and each of
its submodules, ``operators.openai.protocol.requests`` too) with a loader whose module *is*
the new one, imported under its own name. The import system keeps that module's
``__name__``, ``__package__`` and ``__path__`` (they are set), records it in ``sys.modules``
under the old name as well, and runs nothing twice. It does overwrite ``__spec__`` with the
alias's spec, always: the loader puts the module's own back, or ``__spec__.parent`` would
disagree with ``__package__`` (a relative import then warns) and the module would report
the old name. The project's own code imports only the new paths
(``tests/test_layering.py`` checks); docs/design.md has the rule.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import MappingProxyType, ModuleType
from typing import Final, final

__all__ = ("MOVED", "MovedModuleFinder", "install", "new_name")

#: old module name -> new one; a name under an old one moves with it
MOVED: Final[Mapping[str, str]] = MappingProxyType(
    {
        "operators.openai": "operators.edges.openai",
        **{
            f"operators.{name}": f"operators.text.{name}"
            for name in ("stop_jail", "detokenizer", "ascii_encoder", "long_text", "tokenizer")
        },
        **{
            f"operators.{name}": f"operators.routing.{name}"
            for name in ("encoder_router", "prefill_router", "kv_blocks")
        },
        **{
            f"operators.{name}": f"operators.contracts.{name}"
            for name in ("llm", "resumption", "rewriting", "constraint_guard", "transport")
        },
        # the HTTP plumbing every edge shares, out of the OpenAI edge
        **{
            f"operators.edges.openai.{name}": f"operators.edges.http.{name}"
            for name in ("asgi", "guard", "metrics", "runner", "sse_writer", "request_span")
        },
    }
)


def new_name(fullname: str) -> str | None:
    """Where the module once called ``fullname`` lives now, or None if it did not move.

    The longest moved prefix decides; a new name that moved again later is followed
    (``operators.openai.guard`` -> ``operators.edges.openai.guard`` ->
    ``operators.edges.http.guard``).
    """
    if not fullname.startswith("operators."):
        return None
    parts = fullname.split(".")
    for end in range(len(parts), 1, -1):
        old = ".".join(parts[:end])
        new = MOVED.get(old)
        if new is not None:
            moved = new + fullname[len(old) :]
            return new_name(moved) or moved
    return None


@final
class _SameModule(importlib.abc.Loader):
    """Loads an old name as the module already known (or imported now) under the new one."""

    def __init__(self, new: str) -> None:
        self._new = new
        self._own_spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._new)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Runs nothing (the module ran once, under its own name); gives the module back the
        spec that ``importlib`` replaced with the alias's after :meth:`create_module`."""
        module.__spec__ = self._own_spec


@final
class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of moved modules; every other name is left to the next finder."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _SameModule(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): ahead of the path finder, which would
    otherwise load a submodule of an aliased package a second time under the old name."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
