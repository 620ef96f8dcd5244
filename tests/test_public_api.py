"""Every module declares its public API in ``__all__``, and the declarations are honest.

- every module in pipeline/ and operators/ has a tuple ``__all__`` whose names all exist;
- every public class or function a module defines is in its ``__all__``;
- ``pipeline.__all__`` is sorted and lists exactly the names the package re-exports;
- the names the design promises are there, and concrete framework classes are @final.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import pipeline

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "operators")


def _module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts[-1] == "__main__":
                continue
            names.append(".".join(parts))
    return names


MODULES = _module_names()


def _import(name: str) -> ModuleType:
    return importlib.import_module(name)


def test_the_module_list_is_not_empty() -> None:
    assert {"pipeline", "pipeline.context", "pipeline.testing", "operators"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_module_has_a_tuple_all_of_existing_unique_names(name: str) -> None:
    module = _import(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, tuple), f"{name}.__all__ must be a tuple"
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    missing = [item for item in exported if not hasattr(module, item)]
    assert not missing, f"{name}.__all__ names missing attributes: {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_every_public_class_and_function_defined_in_a_module_is_in_its_all(name: str) -> None:
    module = _import(name)
    exported = set(getattr(module, "__all__", ()))
    undeclared = [
        attribute
        for attribute, value in vars(module).items()
        if not attribute.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == name
        and attribute not in exported
    ]
    assert not undeclared, f"{name} defines public names missing from __all__: {undeclared}"


def _reexports(package_init: Path) -> set[str]:
    """Names bound in an ``__init__`` by ``from .x import Name as Name``."""
    names = set()
    for node in ast.parse(package_init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            for alias in node.names:
                if alias.asname == alias.name:
                    names.add(alias.name)
    return names


def test_pipeline_all_is_sorted() -> None:
    assert list(pipeline.__all__) == sorted(pipeline.__all__)


def test_pipeline_all_lists_exactly_the_names_it_re_exports() -> None:
    assert set(pipeline.__all__) == _reexports(ROOT / "pipeline" / "__init__.py")


def test_the_promised_public_surface_exists() -> None:
    from pipeline import errors, routers, testing

    for name in ("Context", "Engine", "Operator", "StateKey", "link", "open_stream"):
        assert name in pipeline.__all__
    for name in ("Router", "RoundRobin", "Random", "LeastLoaded", "Direct", "WorkerSet"):
        assert name in routers.__all__
    assert "MemoryDiscovery" in routers.__all__
    assert {"make_context", "collect", "ScriptedEngine", "check_operator"} <= set(testing.__all__)
    assert "PipelineError" in errors.__all__


def _concrete_public_classes() -> list[tuple[str, type]]:
    found = []
    for module_name in MODULES:
        if not module_name.startswith("pipeline"):
            continue
        module = _import(module_name)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if (
                inspect.isclass(value)
                and value.__module__ == module_name
                and not issubclass(value, BaseException)
                and not getattr(value, "_is_protocol", False)
                and not issubclass(value, tuple)  # NamedTuple snapshots
            ):
                found.append((f"{module_name}.{name}", value))
    return found


@pytest.mark.parametrize(("name", "cls"), _concrete_public_classes())
def test_concrete_framework_classes_are_final(name: str, cls: type) -> None:
    assert getattr(cls, "__final__", False), f"{name} should be decorated with @final"


def test_operators_names_its_serving_entry_points_without_loading_http() -> None:
    """``from operators import build_app, serve`` works; a bare ``import operators`` stays
    light (a fresh interpreter, since this one has loaded everything already)."""
    import subprocess
    import sys

    code = (
        "import sys, operators\n"
        "assert 'uvicorn' not in sys.modules, 'import operators loaded uvicorn'\n"
        "from operators import build_app, default_graph, serve\n"
        "import operators.graph, operators.serving\n"
        "assert build_app is operators.serving.build_app and serve is operators.serving.serve\n"
        "assert default_graph is operators.graph.default_graph\n"
        "try:\n"
        "    operators.nothing\n"
        "except AttributeError as exc:\n"
        "    assert 'nothing' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
