"""Structural rules, checked on the source with ``ast``.

1. The one-way rule: operators/ uses pipeline only through its public modules and names;
   pipeline/ imports nothing from operators, pydantic or tokenizers.
2. No task group or cancel scope is held open across a ``yield``: a generator suspended
   inside one would leave the scope on the wrong task's stack (anyio, "Avoiding cancel
   scope stack corruption"). Context managers are exempt: they are resumed by the task
   that entered them.
3. The floors of operators/: each kind of module imports only from the kinds below it
   (contracts/ and text/ at the ground, the API edges and the engines never of each other,
   the entry points on top); within edges/, the shared plumbing (http/) knows no API and no
   edge imports one beside it but the OpenAI edge (what the graph speaks).
4. Every import of a project module (the tests' helpers too) names one that exists, and a
   name it has: a module that moves leaves no alias behind, and mypy does not read tests/,
   benchmarks/ or scripts/, where a stale path in a function body would only fail when that
   code runs. Nothing there edits ``sys.path``: tests/ and each folder in it are packages, so
   a helper imports by its dotted name (``tests.helpers.server_process``) from the root.
5. No import circles among the project's own modules (operators/ and pipeline/): two
   modules that import each other, directly or around a longer loop, are one module in
   two files (each can be read, tested and changed only with the other).
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
        "pipeline.health",
        "pipeline.priority",
        "pipeline.routers",
        "pipeline.testing",
        "pipeline.tracing",
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
        ("from pipeline.transports.nats import RemoteEngine, serve", False),
        ("from pipeline.transports.nats.client import RemoteEngine", True),
        ("from pipeline.transports.nats import wire", True),
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


# -- 3. the floors of operators/ --------------------------------------------------------------

#: what each kind of module in operators/ may import of the others (besides itself); a kind
#: not listed (graph, serving, testing, cli, the package's __init__) is an entry point on top
MAY_IMPORT: dict[str, frozenset[str]] = {
    # the ground: the types and agreements everything else stands on
    "contracts": frozenset(),
    # text <-> ids: knows no API, engine or route
    "text": frozenset({"contracts"}),
    "routing": frozenset({"contracts", "text"}),
    "parsers": frozenset({"contracts", "text"}),
    "backend": frozenset({"contracts", "text"}),
    "migration": frozenset({"contracts", "text"}),
    # an engine knows no API edge, and an edge no engine: the graph joins them
    "engines": frozenset({"contracts", "text", "routing"}),
    "edges": frozenset({"contracts", "text", "parsers", "backend"}),
    # what the server tells about itself: spans kept, exported, logged (LLM-agnostic)
    "telemetry": frozenset(),
    # the web UI served by the HTTP edge: its status view reads the edge and the spans
    "ui": frozenset({"contracts", "edges", "telemetry"}),
    # the planner reads what the frontends measure (the HTTP edge's histograms) and
    # nothing of a graph: its inputs are NATS messages
    "planner": frozenset({"edges"}),
}


def _module_name(path: Path) -> tuple[str, bool]:
    """(dotted name, is a package) of a source file."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _kind(module: str) -> str | None:
    """The kind of an ``operators`` module: its first name under ``operators``."""
    parts = module.split(".")
    if parts[0] != "operators":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _resolved_imports(
    source: str, module: str, package: bool
) -> Iterator[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every import in ``source`` (of ``module``),
    TYPE_CHECKING ones too, relative ones made absolute."""
    here = module.split(".") if package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            imported = ".".join([*base, *([node.module] if node.module else [])])
            yield node.lineno, imported, [alias.name for alias in node.names]


def _absolute_imports(source: str, module: str, package: bool) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``source`` (of ``module``), TYPE_CHECKING ones too,
    relative ones made absolute; ``from X import name`` also gives ``X.name`` (a submodule?)."""
    for line, imported, names in _resolved_imports(source, module, package):
        yield line, imported
        for name in names:
            yield line, f"{imported}.{name}"


def floor_violations(source: str, module: str, package: bool = False) -> list[str]:
    """The imports of an operators/ module that reach a kind its floor may not."""
    kind = _kind(module)
    allowed = MAY_IMPORT.get(kind or "")
    if allowed is None:
        return []
    return sorted(
        {
            f"line {line}: {imported} ({other}/)"
            for line, imported in _absolute_imports(source, module, package)
            if (other := _kind(imported)) is not None and other != kind and other not in allowed
        }
    )


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("operators.text.stop_jail", "from .detokenizer import byte_level_alphabet", False),
        ("operators.text.stop_jail", "from operators.contracts.llm import EngineOutput", False),
        ("operators.text.stop_jail", "from operators.edges.openai import errors", True),
        ("operators.text.stop_jail", "from ..edges.openai.errors import x", True),
        ("operators.text.stop_jail", "from .. import engines", True),
        ("operators.contracts.llm", "from operators.text.tokenizer import Tokenizer", True),
        ("operators.routing.kv_blocks", "import operators.engines.echo", True),
        ("operators.edges.openai.server", "from operators.backend import CACHED_TOKENS", False),
        ("operators.edges.openai.server", "from operators import engines", True),
        (
            "operators.edges.openai.server",
            "if TYPE_CHECKING:\n    from operators.engines.echo import EchoEngine",
            True,
        ),
        ("operators.engines.echo", "from operators.edges.openai.errors import x", True),
        ("operators.engines.echo", "from operators.cli import main", True),
        ("operators.graph", "from .engines.echo import EchoEngine", False),
    ],
)
def test_the_floor_checker_itself(module: str, source: str, bad: bool) -> None:
    assert bool(floor_violations(source, module)) == bad


#: within edges/: what each edge may import of the others. The plumbing every edge shares
#: (``http``) knows no API; the OpenAI edge holds what the graph speaks (its requests and
#: events), so the Responses and Anthropic edges build on it, and never on each other.
EDGE_MAY_IMPORT: dict[str, frozenset[str]] = {
    "http": frozenset(),
    "openai": frozenset({"http"}),
    "responses": frozenset({"http", "openai"}),
    "anthropic": frozenset({"http", "openai"}),
    "tokens": frozenset({"http", "openai"}),
}


def _edge(module: str) -> str | None:
    """The edge of an ``operators.edges`` module: its name under ``edges``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["operators", "edges"] else None


def edge_violations(source: str, module: str, package: bool = False) -> list[str]:
    """The imports of an edge's module that reach an edge its floor may not."""
    edge = _edge(module)
    allowed = EDGE_MAY_IMPORT.get(edge or "")
    if allowed is None:
        return []
    return sorted(
        {
            f"line {line}: {imported} (edges/{other}/)"
            for line, imported in _absolute_imports(source, module, package)
            if (other := _edge(imported)) is not None and other != edge and other not in allowed
        }
    )


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("operators.edges.http.app", "from .failures import ApiError", False),
        ("operators.edges.http.app", "from operators.edges.openai.errors import x", True),
        ("operators.edges.http.sse_writer", "from ..openai.events import Usage", True),
        ("operators.edges.openai.edge", "from operators.edges.http.routes import Route", False),
        ("operators.edges.openai.edge", "from operators.edges.responses import x", True),
        ("operators.edges.responses.edge", "from operators.edges.openai import errors", False),
        ("operators.edges.responses.edge", "from ..anthropic.errors import x", True),
        ("operators.edges.anthropic.edge", "from operators.edges.responses.store import x", True),
        ("operators.edges.anthropic.edge", "from ..http.generation import Exchange", False),
    ],
)
def test_the_edge_floor_checker_itself(module: str, source: str, bad: bool) -> None:
    assert bool(edge_violations(source, module)) == bad


@pytest.mark.parametrize("path", _sources("operators/edges"), ids=_relative)
def test_edges_import_only_the_edges_below_them(path: Path) -> None:
    problems = edge_violations(path.read_text(), *_module_name(path))
    assert not problems, f"{_relative(path)} imports another edge: " + "; ".join(problems)


def test_every_edge_has_a_floor() -> None:
    edges = {path.name for path in (ROOT / "operators" / "edges").iterdir() if path.is_dir()}
    assert edges - {"__pycache__"} == set(EDGE_MAY_IMPORT)


@pytest.mark.parametrize("path", _sources("operators"), ids=_relative)
def test_operators_modules_import_only_their_floor_and_below(path: Path) -> None:
    problems = floor_violations(path.read_text(), *_module_name(path))
    assert not problems, f"{_relative(path)} imports above its floor: " + "; ".join(problems)


# -- 4. every import names something that exists -----------------------------------------

#: the packages whose modules the project imports by path (``tests`` for the tests' helpers)
PROJECT_PACKAGES = frozenset({"operators", "pipeline", "tests"})


def _module_source(module: str) -> Path | None:
    """The file of a project module (``operators.text`` -> its ``__init__.py``), if any."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _bound_names(source: str) -> set[str]:
    """The names a module binds at its top level (in ``if``/``try`` blocks too) and lists in
    ``__all__`` (a lazy ``__getattr__`` name is in ``__all__``)."""
    names: set[str] = set()
    body = list(ast.parse(source).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and isinstance(
                node.value, ast.Tuple | ast.List
            ):
                names.update(
                    e.value
                    for e in node.value.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                )
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                body.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            body.extend(node.body)
    return names


def missing_imports(source: str, module: str, package: bool = False) -> list[str]:
    """The imports in ``source`` (of ``module``) of a project module that does not exist, or
    of a name that a project module neither binds nor has as a submodule."""
    problems = set()
    for line, imported, names in _resolved_imports(source, module, package):
        if imported.split(".")[0] not in PROJECT_PACKAGES:
            continue
        found = _module_source(imported)
        if found is None:
            problems.add(f"line {line}: no module {imported}")
            continue
        bound = _bound_names(found.read_text()) if names else set()
        problems.update(
            f"line {line}: {imported} has no {name!r}"
            for name in names
            if name != "*" and name not in bound and _module_source(f"{imported}.{name}") is None
        )
    return sorted(problems)


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("from operators.text.stop_jail import StopJail", False),
        ("from operators import Backend, StopJail, build_app", False),
        ("from operators import engines", False),
        ("import operators.edges.openai.server", False),
        ("from pipeline.testing import ScriptedEngine", False),
        ("import os, json\nfrom tokenizers import Tokenizer", False),
        ("import operators.stop_jail", True),
        ("from operators import llm", True),
        ("from operators.openai.protocol.requests import ChatCompletionRequest", True),
        ("from operators.tokenizer import Tokenizer", True),
        ("from operators.text.tokenizer import Tokeniser", True),
        ("def f():\n    from operators.edges.openai.guard import Guard", True),
        ("from tests.helpers.server_process import ServerProcess", False),
        ("from tests.operators.server_process import ServerProcess", True),
    ],
)
def test_the_missing_import_checker_itself(source: str, bad: bool) -> None:
    assert bool(missing_imports(source, "examples.example")) == bad


def test_the_missing_import_checker_resolves_relative_imports() -> None:
    assert missing_imports("from .llm import EngineOutput", "operators", package=True)
    assert not missing_imports("from .contracts.llm import EngineOutput", "operators", True)
    assert missing_imports("from ..http import nope", "operators.edges.openai.server")


def test_the_missing_import_checker_reads_names_bound_in_blocks() -> None:
    module = "if TYPE_CHECKING:\n    from x import A\ntry:\n    B = 1\nexcept E:\n    C = 2\n"
    assert _bound_names(module) >= {"A", "B", "C"}
    lazy = "__all__ = ('lazy',)\ndef f():\n    inner = 1\n"
    assert _bound_names(lazy) == {"__all__", "lazy", "f"}


@pytest.mark.parametrize(
    "path",
    _sources("operators", "pipeline", "tests", "examples", "benchmarks", "scripts"),
    ids=_relative,
)
def test_the_project_imports_only_modules_and_names_that_exist(path: Path) -> None:
    missing = missing_imports(path.read_text(), *_module_name(path))
    assert not missing, f"{_relative(path)} imports what does not exist: " + "; ".join(missing)


def sys_path_edits(source: str) -> list[str]:
    """The lines of ``source`` that change ``sys.path`` (assign to it or call its methods)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if ast.unparse(target) == "sys.path":
                lines.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return lines


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("import sys\nsys.path.insert(0, 'x')", True),
        ("import sys\nsys.path[:0] = ['x']", True),
        ("import sys\nsys.path += ['x']", True),
        ("import sys\nsys.path.append('x')", True),
        ("import sys\nfound = [p for p in sys.path if p]\nsys.argv.append('x')", False),
    ],
)
def test_the_sys_path_checker_itself(source: str, bad: bool) -> None:
    assert bool(sys_path_edits(source)) == bad


def test_no_test_benchmark_script_or_example_edits_sys_path() -> None:
    edits = {
        _relative(path): found
        for path in _sources("tests", "examples", "benchmarks", "scripts")
        if (found := sys_path_edits(path.read_text()))
    }
    assert not edits, f"sys.path edited (import by dotted name instead): {edits}"


def test_test_modules_are_imported_by_their_dotted_names() -> None:
    # ``from server_process import ...`` works only while something put its folder on the
    # path (a sys.path edit, pytest's rootdir insertion of a folder without __init__.py);
    # from a package it is ``from tests.helpers.server_process import ...``.
    stems = {path.stem for path in _sources("tests")} - {"__init__", "conftest"}
    bare = {
        f"{_relative(path)}:{node.lineno}: {ast.unparse(node)}"
        for path in _sources("tests", "examples", "benchmarks", "scripts")
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in stems)
        or (isinstance(node, ast.Import) and any(a.name in stems for a in node.names))
    }
    assert not bare, f"test modules imported by a bare name: {sorted(bare)}"


def test_every_test_folder_is_a_package() -> None:
    # A folder without __init__.py would be imported by its files' bare names again (and a
    # folder named like an installed package, nats/, would shadow it).
    folders = {path.parent for path in _sources("tests")}
    missing = sorted(_relative(f) for f in folders if not (f / "__init__.py").is_file())
    assert not missing, f"test folders without __init__.py: {missing}"


# -- 5. no import circles ----------------------------------------------------------------------


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line} among ``sources`` (module -> (source, is a
    package)): every import, relative, absolute and ``TYPE_CHECKING`` ones alike, read as
    the floor checks read them (:func:`_absolute_imports`: ``from X import name`` imports
    ``X.name`` when that is a module).

    A module's own parent packages are not counted when it only takes submodules of them
    (``from . import sibling``), nor when Python runs them before it: they are not what the
    module depends on. Taking a name a parent defines (``from . import helper``) is."""
    graph: dict[str, dict[str, int]] = {}
    for module, (source, package) in sources.items():
        edges = graph.setdefault(module, {})
        names: dict[tuple[int, str], list[str]] = {}
        for line, imported in _absolute_imports(source, module, package):
            names.setdefault((line, imported.rpartition(".")[0]), []).append(imported)
        for line, imported in _absolute_imports(source, module, package):
            if imported not in sources or imported == module:
                continue
            parent = module.startswith(imported + ".")
            taken = [name for name in names.get((line, imported), []) if name != imported]
            if parent and all(name in sources for name in taken):
                continue  # a parent package run first, or only its submodules taken
            edges.setdefault(imported, line)
    return graph


def import_circles(sources: dict[str, tuple[str, bool]]) -> list[frozenset[str]]:
    """The sets of modules in ``sources`` that import each other in a circle (the graph's
    strongly connected components of more than one module; Tarjan's algorithm)."""
    graph = import_graph(sources)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[frozenset[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = {stack.pop()}
            while module not in component:
                component.add(stack.pop())
            if len(component) > 1:
                circles.append(frozenset(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def _circle_text(circle: frozenset[str], graph: dict[str, dict[str, int]]) -> str:
    """The imports that close ``circle``, one per line: ``a -> b (line n)``."""
    return "\n".join(
        f"  {module} -> {other} (line {line})"
        for module in sorted(circle)
        for other, line in sorted(graph[module].items())
        if other in circle
    )


@pytest.mark.parametrize(
    ("sources", "circles"),
    [
        ({"p.a": ("import p.b", False), "p.b": ("", False)}, []),
        ({"p.a": ("import p.b", False), "p.b": ("import p.a", False)}, [{"p.a", "p.b"}]),
        (
            {
                "p.a": ("from .b import x", False),
                "p.b": ("from . import c", False),
                "p.c": ("if TYPE_CHECKING:\n    from p.a import A", False),
                "p.d": ("from .a import x", False),
            },
            [{"p.a", "p.b", "p.c"}],
        ),
        (
            {
                "p": ("from .a import x", True),
                "p.a": ("from . import y", False),  # a name of the package: a circle
                "p.b": ("import os", False),
            },
            [{"p", "p.a"}],
        ),
        ({"p": ("from .a import x", True), "p.a": ("from .b import y", False)}, []),
        (
            {
                "p": ("from .a import x", True),
                "p.a": ("from . import b\nimport p.b", False),  # submodules only
                "p.b": ("", False),
            },
            [],
        ),
        ({"p.a": ("import p.a", False), "p.b": ("from p.c import z", False)}, []),
        (
            {
                "p.a": ("import p.b", False),
                "p.b": ("import p.a", False),
                "p.c": ("import p.d", False),
                "p.d": ("import p.c", False),
            },
            [{"p.a", "p.b"}, {"p.c", "p.d"}],
        ),
    ],
    ids=[
        "one-way",
        "two",
        "three-relative-type-checking",
        "package",
        "parents",
        "sibling-modules",
        "self",
        "apart",
    ],
)
def test_the_circle_checker_itself(
    sources: dict[str, tuple[str, bool]], circles: list[set[str]]
) -> None:
    assert sorted(map(sorted, import_circles(sources))) == sorted(map(sorted, circles))


def test_no_import_circles() -> None:
    sources = {
        _module_name(path)[0]: (path.read_text(), _module_name(path)[1])
        for path in _sources("operators", "pipeline")
    }
    graph = import_graph(sources)
    found = set(import_circles(sources))
    circles = sorted(found, key=sorted)
    assert not circles, "import circles:\n" + "\n\n".join(_circle_text(c, graph) for c in circles)
