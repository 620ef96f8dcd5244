"""The llama engine's options (``LlamaOptions``), without a model: checked once, each bad
value a ``ValueError`` naming the option, and readable without llama.cpp."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operators.engines.llama import (
    DEFAULT_PARALLEL,
    DEFAULT_STEP_MS,
    DEFAULT_STEP_TOKENS,
    LlamaOptionError,
    LlamaOptions,
    NgramSpeculation,
    parallel_for,
    usable_cpus,
)


def test_the_defaults() -> None:
    options = LlamaOptions()
    assert (options.parallel, options.step_tokens, options.step_ms) == (
        DEFAULT_PARALLEL,
        DEFAULT_STEP_TOKENS,
        DEFAULT_STEP_MS,
    )
    assert (options.n_ctx, options.n_threads, options.role, options.speculative) == (
        2048,
        None,
        "aggregated",
        None,
    )
    assert options.loras == {}


@pytest.mark.parametrize(
    ("given", "option", "problem"),
    [
        ({"n_ctx": 15}, "n_ctx", "must be >= 16, got 15"),
        ({"n_threads": 0}, "n_threads", "must be >= 1, got 0"),
        ({"parallel": 0, "step_tokens": 16}, "parallel", "must be >= 1, got 0"),
        (
            {"parallel": 4, "step_tokens": 15},
            "step_tokens",
            "must be >= parallel (4) and >= 16, got 15",
        ),
        ({"parallel": 32, "step_tokens": 31}, "step_tokens", ">= parallel (32)"),
        ({"step_ms": -1.0}, "step_ms", "must be >= 0, got -1.0"),
        ({"step_ms": math.nan}, "step_ms", "must be >= 0, got nan"),
        ({"block_size": 0}, "block_size", "must be >= 1, got 0"),
        ({"role": "encode"}, "role", "must be 'aggregated', 'prefill' or 'decode'"),
        ({"transfer_timeout": 0.0}, "transfer_timeout", "must be a number of seconds > 0"),
        ({"transfer_timeout": math.nan}, "transfer_timeout", "> 0, got nan"),
        ({"kv_host_cache_mb": -1}, "kv_host_cache_mb", "must be >= 0, got -1"),
        ({"kv_disk_cache_mb": -1}, "kv_disk_cache_mb", "must be >= 0, got -1"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_option(
    given: dict[str, Any], option: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=f"^{option} ") as caught:
        LlamaOptions(**given)
    error = caught.value
    assert isinstance(error, LlamaOptionError)
    assert (error.option, problem in error.problem) == (option, True)
    assert str(error) == f"{option} {error.problem}"


def test_options_are_frozen_and_replaced_checked_again() -> None:
    options = LlamaOptions(parallel=2, speculative=NgramSpeculation(ngram_size=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.parallel = 3  # type: ignore[misc]
    assert dataclasses.replace(options, role="prefill").role == "prefill"
    with pytest.raises(LlamaOptionError, match=r"^step_tokens "):
        dataclasses.replace(options, step_tokens=8)


def test_the_options_import_without_loading_llama_cpp() -> None:
    """The command line reads them at import, on a bare install too (a fresh interpreter:
    this one has loaded llama.cpp already)."""
    code = (
        "import sys\n"
        "from operators.engines.llama import LlamaOptions\n"
        "import operators.cli\n"
        "LlamaOptions(parallel=2)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('llama_cpp', 'numpy', 'llguidance'))\n"
        "assert not loaded, loaded\n"
        "from operators.engines.llama import LlamaEngine\n"
        "assert LlamaEngine.__module__ == 'operators.engines.llama.engine'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_parallel_above_what_the_build_allows_is_refused_naming_it() -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [llama] extra")
    from operators.engines.llama import LlamaEngine

    most = int(llama_cpp.llama_max_parallel_sequences())
    too_many = LlamaOptions(parallel=most + 1, step_tokens=most + 1)
    with pytest.raises(LlamaOptionError, match=f"^parallel must be at most {most}"):
        LlamaEngine("/nowhere.gguf", options=too_many)  # refused before the model is looked for


@given(st.integers(min_value=1, max_value=4096))
def test_the_default_parallel_grows_with_the_cpus_within_its_bounds(cpus: int) -> None:
    slots = parallel_for(cpus)
    assert 4 <= slots <= 16
    assert parallel_for(cpus + 1) >= slots
    assert slots == min(4 * cpus, 16)


def test_the_default_parallel_is_this_machines() -> None:
    assert DEFAULT_PARALLEL == LlamaOptions().parallel == parallel_for(usable_cpus())
    assert parallel_for(2) == 8  # the two-core machine the benchmarks ran on


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_process_limited_to_one_cpu_gets_four_slots_and_says_so_in_the_help() -> None:
    # (a container's cpuset is an affinity too: the default follows it, not the host's CPUs)
    script = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from operators.engines.llama import LlamaOptions; print(LlamaOptions().parallel); "
        "sys.argv = ['llm-pipeline', 'serve', '--help']; "
        "from operators.cli.command import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    slots, _, help_text = done.stdout.partition("\n")
    assert slots == "4", done.stderr
    assert "16: 4 here)" in " ".join(help_text.split())
