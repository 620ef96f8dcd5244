"""``serve --insert-before STAGE=MODULE:NAME``: user operators spliced into the served
graph, the same ``before=`` that :func:`operators.serving.build_app` takes from Python.

``NAME`` is called with no arguments (a class, or a function returning an operator), so
what the command line can insert is exactly what a user can build in Python; anything
that needs arguments gets a small factory function in the user's module.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterable
from typing import Any

from operators.graph import POINTS, Point, check_insertion
from pipeline import LinkError

__all__ = ("insertion", "load_insertions", "load_operator")

_AnyOperator = Any


def insertion(text: str) -> tuple[Point, str]:
    """An argparse type: ``STAGE=MODULE:NAME`` checked for its shape and stage name."""
    stage, sep, spec = text.partition("=")
    module, colon, name = spec.partition(":")
    if not sep or not colon or not module or not name:
        raise argparse.ArgumentTypeError(f"expected STAGE=MODULE:NAME, got {text!r}")
    if stage not in POINTS:
        raise argparse.ArgumentTypeError(
            f"no stage {stage!r} in the default graph; the stages are "
            + ", ".join(repr(point) for point in POINTS)
        )
    return stage, spec


def load_operator(spec: str) -> _AnyOperator:
    """The operator ``MODULE:NAME()`` makes.

    Raises:
        ValueError: the module or name cannot be imported, calling it fails, or what it
            returns has no ``generate`` method (the cause is chained).
    """
    module_name, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {spec}: {exc}") from exc
    try:
        operator = factory()
    except Exception as exc:  # the user's factory, whatever it raises
        raise ValueError(f"{spec}() failed: {exc!r}") from exc
    if not callable(getattr(operator, "generate", None)):
        raise ValueError(f"{spec}() returned {operator!r}, which has no generate() method")
    return operator


def load_insertions(pairs: Iterable[tuple[Point, str]]) -> dict[Point, list[_AnyOperator]]:
    """``before=`` for the graph: each point's operators, in command-line order.

    Raises:
        ValueError: as :func:`load_operator`, or an operator's ``generate`` annotations do
            not fit its point (:func:`operators.graph.check_insertion`, said before the
            server starts, not as a 500 on the first request).
    """
    before: dict[Point, list[_AnyOperator]] = {}
    for point, spec in pairs:
        operator = load_operator(spec)
        try:
            check_insertion(point, operator)
        except LinkError as exc:
            raise ValueError(f"{spec}: {exc}") from exc
        before.setdefault(point, []).append(operator)
    return before
