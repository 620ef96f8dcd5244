"""Without the nats extra the NATS tests skip instead of failing at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

#: run pytest on the NATS test modules as if nats-py and msgpack were not installed
_WITHOUT_NATS = """
import sys

class NotInstalled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in ("nats", "msgpack"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled)
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_the_nats_tests_skip_without_the_extra() -> None:
    modules = [
        *sorted(ROOT.glob("tests/pipeline/transports/**/test_*.py")),
        *sorted(ROOT.glob("tests/operators/cli/test_cli_nats*.py")),
    ]
    modules.remove(Path(__file__).resolve())  # this one runs without the extra
    paths = [str(module.relative_to(ROOT)) for module in modules]
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NATS, *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # every module skips at import, so pytest collected no test (and nothing failed)
    assert run.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, run.stdout + run.stderr
    assert f"{len(modules)} skipped" in run.stdout
    assert len(modules) >= 8
    assert "need the nats extra" in run.stdout
