"""The core's tests really run on both backends (see conftest.py), under the time limit."""

from __future__ import annotations

import inspect
from pathlib import Path

import anyio
import pytest
import sniffio
from pytest_asyncio import is_async_test

from pipeline.testing import ScriptedEngine, collect, make_context


async def test_runs_on_the_backend_its_id_names(anyio_backend: str) -> None:
    assert anyio_backend in ("asyncio", "trio")
    assert sniffio.current_async_library() == anyio_backend


async def test_the_core_runs_here(anyio_backend: str) -> None:
    assert await collect(ScriptedEngine(["a"]), make_context(None)) == ["a"]
    assert sniffio.current_async_library() == anyio_backend


def test_every_async_test_here_is_collected_once_per_backend(
    request: pytest.FixtureRequest,
) -> None:
    items = [
        item
        for item in request.session.items
        if item.path == request.node.path and item.name.startswith("test_runs_on_the_backend")
    ]
    assert sorted(item.name for item in items) == [
        "test_runs_on_the_backend_its_id_names[asyncio]",
        "test_runs_on_the_backend_its_id_names[trio]",
    ]


async def test_the_suite_time_limit_applies_on_every_backend() -> None:
    # The root conftest wraps the test in anyio.fail_after(TEST_TIME_LIMIT): the limit is
    # visible as this task's effective deadline.
    assert anyio.current_effective_deadline() < anyio.current_time() + 11


def test_every_async_core_test_runs_on_both_backends(request: pytest.FixtureRequest) -> None:
    here = Path(__file__).parent
    backends: dict[str, set[str]] = {}
    for item in request.session.items:
        if not isinstance(item, pytest.Function) or here not in item.path.parents:
            continue
        if here / "transports" in item.path.parents:
            continue  # nats-py is asyncio-only: these stay on pytest-asyncio
        inner = getattr(getattr(item.obj, "hypothesis", None), "inner_test", item.obj)
        if not inspect.iscoroutinefunction(inner):
            continue
        assert not is_async_test(item), f"{item.nodeid} is still run by pytest-asyncio"
        callspec = getattr(item, "callspec", None)
        assert callspec is not None, f"{item.nodeid} is not parametrized over backends"
        key = f"{item.path}::{item.originalname}"
        backends.setdefault(key, set()).add(callspec.params["anyio_backend"])
    assert backends, "no async core tests were collected"
    wrong = {key: found for key, found in backends.items() if found != {"asyncio", "trio"}}
    assert not wrong
