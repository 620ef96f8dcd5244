"""Test doubles for people who write operators and engines (public API).

A whole test of an operator fits in three lines::

    engine = ScriptedEngine(["a", "b"])
    assert await collect(link(Upper(), engine), make_context("req")) == ["A", "B"]
    await check_operator(Upper, "req", ["a", "b", "c"])

:func:`check_operator` is a conformance suite in the manner of trio's
``check_one_way_stream``: run it once against your operator and it checks the contract every
operator in a graph must keep.

The framework's test helpers have two homes, as the code has two layers. This module holds
what knows no LLM: :func:`check_operator`, :func:`make_context`, :class:`ScriptedEngine`,
:func:`worker_set`, :func:`collect`. :mod:`operators.testing` holds what needs the LLM
layer: ``check_engine`` (the engine contract), ``make_request`` (a ``PreprocessedRequest``
from flat keywords, to put in a :func:`make_context`) and the in-process ``openai_client``
and ``anthropic_client``. They cannot live here: ``pipeline`` never imports ``operators``
(``tests/test_layering.py``), so a helper that builds an LLM request belongs beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import anyio

from ._scripted import ScriptedEngine
from .conformance import CheckTimeout, ConformanceError, check_operator
from .context import Context
from .operator import Engine
from .routers import WorkerSet
from .streams import open_stream

__all__ = (
    "CheckTimeout",
    "ConformanceError",
    "ScriptedEngine",
    "check_operator",
    "collect",
    "make_context",
    "worker_set",
)

T = TypeVar("T")
Out = TypeVar("Out")


def make_context(
    data: T,
    *,
    id: str | None = None,  # noqa: A002
    metadata: Mapping[str, str] | None = None,
    deadline: float | None = None,
    timeout: float | None = None,
) -> Context[T]:
    """A fresh root Context for ``data``.

    ``timeout`` (seconds from now, needs a running event loop) is a shorthand for
    ``deadline``.
    """
    if timeout is not None:
        deadline = anyio.current_time() + timeout
    return Context.new(data, id=id, metadata=metadata, deadline=deadline)


def worker_set(*engines: Engine[Any, Out], name: str = "workers") -> WorkerSet[Any, Out]:
    """A WorkerSet of ``engines`` with ids ``worker-0``, ``worker-1``, ...

    With :class:`ScriptedEngine` workers it makes failover testable in one line::

        workers = worker_set(
            ScriptedEngine([out1], then=StreamDisconnected("worker died")),
            ScriptedEngine([out2]),
        )
        graph = link(Migration(), Backend(tokenizer), Router(workers))
    """
    return WorkerSet(name, {f"worker-{i}": engine for i, engine in enumerate(engines)})


async def collect(engine: Engine[T, Out], ctx: Context[T]) -> list[Out]:
    """Run ``engine`` for ``ctx`` to the end and return every output.

    Driven by :func:`pipeline.open_stream`, so a kill or a passed deadline ends it early
    with what arrived so far; any exception propagates.
    """
    outputs: list[Out] = []
    async with open_stream(engine, ctx) as stream:
        # One append per item, not a comprehension: a kill must keep what already arrived.
        async for item in stream:
            outputs.append(item)  # noqa: PERF401
    return outputs
