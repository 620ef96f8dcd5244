"""The old module paths of ``operators`` (before edges/, text/, routing/, contracts/) still import,
as the very same module objects as the new paths (``operators._moved``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import operators
from operators._moved import MOVED, new_name

ROOT = Path(__file__).resolve().parents[2]


def _old_and_new() -> list[tuple[str, str]]:
    """Every module under a moved name, submodules of moved packages included."""
    pairs = []
    for old, new in MOVED.items():
        base = ROOT.joinpath(*new.split("."))
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for path in files:
            parts = list(path.relative_to(base).with_suffix("").parts) if base.is_dir() else []
            if parts and parts[-1] == "__init__":
                parts.pop()
            suffix = "".join(f".{part}" for part in parts)
            pairs.append((old + suffix, new + suffix))
    return pairs


PAIRS = _old_and_new()


def test_every_moved_module_and_submodule_is_listed() -> None:
    names = {old for old, _ in PAIRS}
    assert {
        "operators.stop_jail",
        "operators.llm",
        "operators.kv_blocks",
        "operators.rewriting",
        "operators.tokenizer",
        "operators.tokenizer.config",
        "operators.openai",
        "operators.openai.server",
        "operators.openai.protocol",
        "operators.openai.protocol.requests",
    } <= names
    assert len(PAIRS) > len(MOVED)


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[old for old, _ in PAIRS])
def test_an_old_path_imports_the_same_module_as_the_new_one(old: str, new: str) -> None:
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module is sys.modules[old] is sys.modules[new]
    # the module keeps its own identity: name, spec and package agree (relative imports check)
    assert module.__name__ == new
    assert module.__spec__ is not None
    assert module.__spec__.name == new
    assert module.__spec__.parent == module.__package__


def test_classes_are_the_same_across_both_names() -> None:
    from operators.llm import PreprocessedRequest as OldPreprocessedRequest
    from operators.openai.protocol.requests import ChatCompletionRequest as OldChatRequest

    from operators.contracts.llm import PreprocessedRequest
    from operators.edges.openai.protocol.requests import ChatCompletionRequest

    assert OldPreprocessedRequest is PreprocessedRequest
    assert OldChatRequest is ChatCompletionRequest


def test_from_operators_import_an_old_module_name() -> None:
    from operators import kv_blocks, openai

    assert kv_blocks is importlib.import_module("operators.routing.kv_blocks")
    assert openai is importlib.import_module("operators.edges.openai")
    assert operators.rewriting is importlib.import_module("operators.contracts.rewriting")


@pytest.mark.parametrize(
    "name",
    ["operators.nope", "operators.openai.nope", "operators.tokenizer.nope", "operators.llmx"],
)
def test_a_name_that_never_existed_is_still_not_found(name: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_only_moved_names_are_redirected() -> None:
    assert new_name("operators.openai.protocol.requests") == (
        "operators.edges.openai.protocol.requests"
    )
    assert new_name("operators.stop_jail") == "operators.text.stop_jail"
    # moved twice: into edges/openai, then into the plumbing every edge shares
    assert new_name("operators.openai.guard") == "operators.edges.http.guard"
    assert new_name("operators.edges.openai.sse_writer") == "operators.edges.http.sse_writer"
    assert new_name("operators.edges.openai.server") is None
    for name in ("operators", "operators.backend", "operators.llmx", "openai", "operators.edges"):
        assert new_name(name) is None
    with pytest.raises(AttributeError):
        _ = operators.no_such_thing


@pytest.mark.parametrize(
    "code",
    [
        "import operators.stop_jail",
        "import operators.openai.protocol.requests as old\n"
        "import operators.edges.openai.protocol.requests as new\n"
        "assert old is new and old.__spec__.name == new.__name__",
        "from operators.tokenizer.config import TokenizerMetadata\n"
        "from operators.text.tokenizer.config import TokenizerMetadata as New\n"
        "assert TokenizerMetadata is New",
        "import operators\n"
        "assert operators.llm.PreprocessedRequest is operators.PreprocessedRequest",
        "from operators.openai.guard import Guard\n"
        "from operators.edges.openai.guard import Guard as Moved\n"
        "from operators.edges.http.guard import Guard as New\n"
        "assert Guard is Moved is New",
    ],
    ids=["stop_jail", "old-before-new", "from-import", "attribute", "moved-twice"],
)
def test_old_paths_in_a_fresh_interpreter(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
