"""The bare install (no extras) works: ``scripts/bare_install_checks.py`` with every
extra's packages made unimportable. CI also runs the same checks in a real venv that has
only ``pip install .`` (``.ci/run``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_bare_install_starts_and_serves() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bare_install_checks.py"), "--simulate"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
