"""Structural rules, checked on the source with ``ast``.

1. The one-way rule: operators/ uses pipeline only through its public modules and names;
   pipeline/ imports nothing from operators, pydantic or tokenizers.
2. No task group or cancel scope is held open across a ``yield``: a generator suspended
   inside one would leave the scope on the wrong task's stack (anyio, "Avoiding cancel
   scope stack corruption"). Context managers are exempt: they are resumed by the task
   that entered them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import pipeline

ROOT = Path(__file__).resolve().parent.parent

#: modules of pipeline that other packages may import
PUBLIC_MODULES = frozenset(
    {
        "pipeline",
        "pipeline.errors",
        "pipeline.routers",
        "pipeline.testing",
        "pipeline.transports",
        "pipeline.transports.codec",
        "pipeline.transports.nats",
        "pipeline.transports.roles",
    }
)
#: top-level packages pipeline must never import
FORBIDDEN_IN_PIPELINE = frozenset({"operators", "pydantic", "tokenizers"})


def _sources(*packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (ROOT / package).rglob("*.py"))


def _imports(tree: ast.AST) -> Iterator[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every import, TYPE_CHECKING ones too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- 1. layering ------------------------------------------------------------------------------


def pipeline_import_violations(source: str) -> list[str]:
    """How ``source`` (a module outside pipeline) reaches past pipeline's public API."""
    problems = []
    for line, module, names in _imports(ast.parse(source)):
        if module != "pipeline" and not module.startswith("pipeline."):
            continue
        if module not in PUBLIC_MODULES:
            problems.append(f"line {line}: imports internal module {module}")
            continue
        if module == "pipeline":
            allowed = set(pipeline.__all__) | {m.split(".")[1] for m in PUBLIC_MODULES if "." in m}
        else:
            allowed = set(getattr(__import__(module, fromlist=["__all__"]), "__all__", ()))
        for name in names:
            if name not in allowed:
                problems.append(f"line {line}: imports {name!r} from {module}, not public")
    return problems


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("from pipeline import Context, link", False),
        ("from pipeline.testing import ScriptedEngine", False),
        ("from pipeline.routers import RoundRobin", False),
        ("from pipeline.errors import WorkerLost", False),
        ("from pipeline import errors, routers, testing", False),
        ("import pipeline", False),
        ("import os\nfrom pipelines import x", False),
        ("from pipeline.context import Context", True),
        ("from pipeline.link import link", True),
        ("import pipeline.streams", True),
        ("from pipeline import context", True),
        ("from pipeline import _Controller", True),
        ("from pipeline.testing import _ProbeError", True),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline.link import x",
            True,
        ),
    ],
)
def test_the_layering_checker_itself(source: str, bad: bool) -> None:
    assert bool(pipeline_import_violations(source)) == bad


@pytest.mark.parametrize("path", _sources("operators"), ids=_relative)
def test_operators_use_pipeline_only_through_its_public_api(path: Path) -> None:
    problems = pipeline_import_violations(path.read_text())
    assert not problems, f"{_relative(path)}: " + "; ".join(problems)


@pytest.mark.parametrize("path", _sources("pipeline"), ids=_relative)
def test_pipeline_imports_no_operators_pydantic_or_tokenizers(path: Path) -> None:
    bad = [
        f"line {line}: {module}"
        for line, module, _ in _imports(ast.parse(path.read_text()))
        if module.split(".")[0] in FORBIDDEN_IN_PIPELINE
    ]
    assert not bad, f"{_relative(path)} imports {bad}"


def test_importing_pipeline_loads_no_llm_dependencies() -> None:
    forbidden = sorted(FORBIDDEN_IN_PIPELINE)
    code = (
        "import sys, pipeline, pipeline.errors, pipeline.routers, pipeline.testing\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


# -- 2. no scope held across a yield ----------------------------------------------------------

#: calls whose ``with`` block holds a task group or cancel scope open
SCOPE_OPENERS = frozenset(
    {
        "create_task_group",
        "TaskGroup",
        "CancelScope",
        "move_on_after",
        "move_on_at",
        "fail_after",
        "fail_at",
        "open_stream",
    }
)
#: decorators that make a generator a context manager, resumed by the task that entered it
EXEMPT_DECORATORS = frozenset({"asynccontextmanager", "contextmanager"})


def _called_name(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr
    return None


def _decorator_name(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Call):
        expr = expr.func
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


class _ScopeAcrossYield(ast.NodeVisitor):
    def __init__(self) -> None:
        self.problems: list[str] = []
        self._function: str | None = None
        self._open: list[tuple[str, int]] = []  # (opener, line) of enclosing scope blocks

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        saved = self._function, self._open
        exempt = not isinstance(node, ast.Lambda) and any(
            _decorator_name(d) in EXEMPT_DECORATORS for d in node.decorator_list
        )
        self._function = None if exempt else getattr(node, "name", "<lambda>")
        self._open = []
        self.generic_visit(node)
        self._function, self._open = saved

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function
    visit_Lambda = _visit_function

    def _visit_with(self, node: ast.With | ast.AsyncWith) -> None:
        openers = [
            (name, node.lineno)
            for item in node.items
            if (name := _called_name(item.context_expr)) in SCOPE_OPENERS
        ]
        for item in node.items:
            self.visit(item)
        self._open.extend(openers)
        for statement in node.body:
            self.visit(statement)
        del self._open[len(self._open) - len(openers) :]

    visit_With = _visit_with
    visit_AsyncWith = _visit_with

    def _visit_yield(self, node: ast.Yield | ast.YieldFrom) -> None:
        if self._function is not None and self._open:
            opener, line = self._open[-1]
            self.problems.append(
                f"line {node.lineno}: {self._function}() yields inside {opener}() "
                f"opened on line {line}"
            )
        self.generic_visit(node)

    visit_Yield = _visit_yield
    visit_YieldFrom = _visit_yield


def scopes_across_yields(source: str) -> list[str]:
    """Every ``yield`` in ``source`` made while its function holds a scope open."""
    checker = _ScopeAcrossYield()
    checker.visit(ast.parse(textwrap.dedent(source)))
    return checker.problems


_BAD = {
    "task-group": """
        async def gen(items):
            async with anyio.create_task_group() as tg:
                for item in items:
                    yield item
    """,
    "bare-task-group": """
        async def gen():
            async with create_task_group() as tg, something_else():
                yield 1
    """,
    "cancel-scope": """
        async def gen():
            with anyio.CancelScope(shield=True):
                yield 1
    """,
    "move-on-after": """
        async def gen():
            try:
                with move_on_after(1):
                    if True:
                        x = yield 1
            finally:
                pass
    """,
    "fail-after-in-method": """
        class Op:
            async def generate(self, ctx, downstream):
                async for item in downstream.generate(ctx):
                    with anyio.fail_after(5):
                        yield item
    """,
    "open-stream": """
        async def gen(engine, ctx):
            async with open_stream(engine, ctx) as stream:
                async for item in stream:
                    yield item
    """,
    "sync-generator": """
        def gen():
            with CancelScope():
                yield 1
    """,
}

_GOOD = {
    "closed-before-yield": """
        async def gen(items):
            async with anyio.create_task_group() as tg:
                for item in items:
                    tg.start_soon(work, item)
            yield 1
    """,
    "async-context-manager": """
        @contextlib.asynccontextmanager
        async def opened(engine, ctx):
            with anyio.CancelScope() as scope:
                yield scope
    """,
    "context-manager": """
        @contextmanager
        def limited():
            with fail_after(1):
                yield
    """,
    "nested-function-owns-its-yield": """
        async def outer():
            async with create_task_group() as tg:
                async def inner():
                    yield 1
                tg.start_soon(consume, inner())
    """,
    "other-with-blocks": """
        async def gen(path):
            with open(path) as f:
                async with aclosing(stream()) as s:
                    yield f.read()
    """,
    "scope-in-a-coroutine": """
        async def wait():
            with anyio.move_on_after(1):
                await anyio.sleep(2)
    """,
}


@pytest.mark.parametrize("source", _BAD.values(), ids=_BAD.keys())
def test_the_scope_checker_finds_a_yield_inside_a_scope(source: str) -> None:
    assert len(scopes_across_yields(source)) == 1


@pytest.mark.parametrize("source", _GOOD.values(), ids=_GOOD.keys())
def test_the_scope_checker_allows_safe_code(source: str) -> None:
    assert scopes_across_yields(source) == []


@pytest.mark.parametrize("path", _sources("pipeline", "operators"), ids=_relative)
def test_no_task_group_or_cancel_scope_is_held_across_a_yield(path: Path) -> None:
    problems = scopes_across_yields(path.read_text())
    assert not problems, f"{_relative(path)}: " + "; ".join(problems)
