"""Every example in examples/ runs as a script, exits 0 and prints what it should.

To add an example, drop it in examples/ and add an entry to ``RUNS`` with the substrings
its output must contain (and any command-line flags it needs). An example that imports
a package which is not installed is skipped, naming the package.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@dataclass(frozen=True)
class Run:
    """How to run one example and what its output must contain."""

    expect: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    skip: str | None = None
    timeout: float = 60.0


RUNS: dict[str, Run] = {
    "hello_pipeline.py": Run(expect=("HELLO!\nPIPELINE!\nWORLD!\n",)),
    "custom_operator.py": Run(expect=("Upper passes check_operator",)),
    "custom_engine.py": Run(
        expect=(
            "canned_engine passes check_engine\n",
            "['Hello from my own engine', 'Hello from my own engine']\n",
        )
    ),
    "serve_from_python.py": Run(expect=(": 'Hello!'\n", "stopped\n")),
    "rewrite_request.py": Run(
        expect=("'system\\nBe brief.\\n' length\n", "lost workers: ['retried']\n")
    ),
    "test_with_pytest.py": Run(expect=("3 passed",)),
    "disaggregated.py": Run(
        expect=(
            "served by: encode e1, prefill p1, decode d1\n",
            "gives the same answer: True\n",
        )
    ),
    "kv_routing.py": Run(
        expect=(
            "alice: every turn on one worker: True\n",
            "bob: every turn on one worker: True\n",
            "5 of 5 blocks cached\n",
        )
    ),
    "custom_tool_parser.py": Run(
        expect=(
            "content: 'Let me check. '\n",
            'call: get_weather({"city": "Paris"})\n',
            "finish_reason: tool_calls\n",
        )
    ),
    "custom_edge.py": Run(
        expect=(
            "whole: {'text': 'Hello, plain world'}\n",
            'streamed: data: {"text":"Hi"} | data: {"text":" there"} | event: done data: {}\n',
            'counted: endpoint="/v1/plain",model="echo",status="200"} 2.0\n',
        )
    ),
    "engine_health.py": Run(
        expect=(
            "answer: 'Still here.'\n",
            "after its death: /ready 503: {'ready': False, 'reason': 'flaky: engine died "
            "(its process was killed); restarting'}\n",
            "rebuilt, the same answer: True (1 restart)\n",
        )
    ),
    "extend_default_graph.py": Run(
        expect=(
            "HELLO FROM THE GRAPH\n",
            "OpenAIPreprocessor -> OutputParsers -> Migration -> Shout -> Backend -> "
            "EncoderRouter -> "
            "PrefillRouter -> engine\n",
        )
    ),
}


def _missing_imports(path: Path) -> list[str]:
    """Top-level packages ``path`` imports that are not installed."""
    missing = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if importlib.util.find_spec(top) is None:
                missing.add(top)
    return sorted(missing)


def test_there_are_examples() -> None:
    assert set(RUNS) <= {path.name for path in EXAMPLES}


def test_every_example_has_its_expected_output() -> None:
    assert set(RUNS) == {path.name for path in EXAMPLES}
    assert all(run.expect or run.skip for run in RUNS.values())


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_runs(path: Path) -> None:
    run = RUNS.get(path.name, Run())
    if run.skip:
        pytest.skip(run.skip)
    missing = _missing_imports(path)
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)}")
    result = subprocess.run(
        [sys.executable, "-W", "error::ResourceWarning", str(path), *run.args],
        capture_output=True,
        text=True,
        timeout=run.timeout,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, f"{path.name} exited {result.returncode}:\n{result.stderr}"
    assert "Exception ignored" not in result.stderr, result.stderr
    for expected in run.expect:
        assert expected in result.stdout, f"{path.name} printed:\n{result.stdout}"
