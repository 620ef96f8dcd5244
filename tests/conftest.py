"""Shared test configuration: every async test runs under a time limit.

pytest-asyncio runs an async fixture's setup, the test body and the fixture's teardown as
three separate tasks, so the usual ``async def`` fixture that yields inside
``anyio.fail_after(...)`` does not limit the test at all (and its teardown fails with
"Attempted to exit cancel scope in a different task"). Instead, a plain autouse fixture
wraps the test function itself before the plugin runs it, so the limit is entered and
left in the test's own task. For Hypothesis tests the limit applies to each example.

The same wrapper limits the tests anyio's plugin runs (``tests/pipeline`` runs its tests
on asyncio and trio, see its conftest).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from pytest_asyncio import is_async_test

#: seconds any one async test (or Hypothesis example) may run, unless it is marked
#: ``@pytest.mark.time_limit(seconds)`` (a real model answering many requests)
TEST_TIME_LIMIT = 10.0


def _time_limited(
    test: Callable[..., Awaitable[Any]], limit: float = TEST_TIME_LIMIT
) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(test)
    async def limited(*args: Any, **kwargs: Any) -> Any:
        with anyio.fail_after(limit, reason=f"test ran over {limit:g}s"):
            return await test(*args, **kwargs)

    return limited


@pytest.fixture(autouse=True)
def _async_time_limit(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put every async test under ``anyio.fail_after(TEST_TIME_LIMIT)``."""
    item = request.node
    if not (is_async_test(item) or _runs_under_anyio(item)):
        return
    marker = item.get_closest_marker("time_limit")
    limit = TEST_TIME_LIMIT if marker is None else float(marker.args[0])
    hypothesis = getattr(item.obj, "hypothesis", None)
    if hypothesis is not None:
        monkeypatch.setattr(hypothesis, "inner_test", _time_limited(hypothesis.inner_test, limit))
    else:
        monkeypatch.setattr(item, "obj", _time_limited(item.obj, limit))


def _runs_under_anyio(item: pytest.Item) -> bool:
    if not isinstance(item, pytest.Function) or "anyio_backend" not in item.fixturenames:
        return False
    hypothesis = getattr(item.obj, "hypothesis", None)
    return inspect.iscoroutinefunction(item.obj if hypothesis is None else hypothesis.inner_test)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Close the two ``/dev/null`` files llama-cpp-python opens at import and never closes:
    once vLLM (torch) is imported in the same process they are finalized under the suite's
    ``error`` filter at exit, and their ResourceWarning would print after the summary."""
    import sys

    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        file = getattr(utils, name, None)
        if file is not None:
            file.close()
