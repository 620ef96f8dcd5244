"""The suite's time limit: 10 s for every async test, or what ``time_limit`` says."""

from __future__ import annotations

import anyio
import pytest

from tests.conftest import TEST_TIME_LIMIT


async def test_an_async_test_runs_under_the_suites_limit() -> None:
    left = anyio.current_effective_deadline() - anyio.current_time()
    assert 0 < left <= TEST_TIME_LIMIT


@pytest.mark.time_limit(300)
async def test_a_marked_test_runs_under_its_own_limit() -> None:
    left = anyio.current_effective_deadline() - anyio.current_time()
    assert TEST_TIME_LIMIT < left <= 300
