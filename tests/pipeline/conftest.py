"""Run the core's async tests on asyncio and on trio: pipeline/ claims to be backend-agnostic.

The rest of the suite runs under pytest-asyncio's auto mode, which claims every coroutine
test as it is collected and runs it on an asyncio loop. For the tests here that claim is
undone: an outer ``pytest_pycollect_makeitem`` wrapper makes each such test use the
``anyio_backend`` fixture (parametrized over :data:`BACKENDS`) and hands the items
pytest-asyncio made back as plain ``pytest.Function`` items, so anyio's pytest plugin runs
each test once per backend (ids ``[asyncio]`` and ``[trio]``).

The NATS transport tests (``transports/``) stay on pytest-asyncio: nats-py is asyncio-only.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from pytest_asyncio import is_async_test

#: every backend the core must run on; trio is in the ``test`` extra, so a missing trio
#: fails these tests instead of quietly running them on asyncio only
BACKENDS = ("asyncio", "trio")

_HERE = Path(__file__).parent
_ASYNCIO_ONLY = _HERE / "transports"


def _on_every_backend(path: Path, function: object) -> bool:
    if _ASYNCIO_ONLY in path.parents or not path.is_relative_to(_HERE):
        return False
    inner = getattr(getattr(function, "hypothesis", None), "inner_test", function)
    return inspect.iscoroutinefunction(inner)


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The backend anyio's plugin runs the test on (overrides the plugin's own fixture)."""
    backend: str = request.param
    return backend


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Generator[None, Any, Any]:
    if not _on_every_backend(collector.path, obj):
        return (yield)
    pytest.mark.usefixtures("anyio_backend")(obj)  # before its fixtures are resolved
    result = yield
    if not result:
        return result
    items = result if isinstance(result, list) else [result]
    return [_unclaimed(item) if is_async_test(item) else item for item in items]


def _unclaimed(item: pytest.Function) -> pytest.Function:
    """``item`` as a plain Function, without the asyncio mark auto mode gave it."""
    keywords = {key: value for key, value in item.keywords.items() if key != "asyncio"}
    return pytest.Function.from_parent(
        item.parent,
        name=item.name,
        callspec=getattr(item, "callspec", None),
        callobj=item.obj,
        fixtureinfo=item._fixtureinfo,
        keywords=keywords,
        originalname=item.originalname,
    )
