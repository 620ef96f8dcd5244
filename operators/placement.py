"""What an operator's ``generate`` says it takes and yields, and whether that fits a place.

mypy checks that an operator fits where it is linked (``link``'s overloads, the overloads
of :meth:`operators.graph.Stages.insert_before`), but only for code mypy sees: a graph
built from a ``--insert-before`` flag, from a list, or by code that is not type-checked
gets a misplaced operator past it, and its first request then fails deep inside with a
bare 500. :class:`~operators.graph.Stages` asks this module instead, when the graph is
built, and names the stage and the operator.

What is read is what mypy reads, the annotations of::

    def generate(self, ctx: Context[Req], downstream: Engine[DownReq, DownOut]) -> Stream[Out]

(``AsyncIterator``, ``AsyncGenerator`` and ``AsyncIterable`` are read like ``Stream``). No
declaration of another kind is asked for. The check only finds clear mismatches, so
nothing that works is refused: an operator without annotations, with ``Any``, a type
variable, a Protocol or a generic alias, or with annotations that do not resolve at run
time (names imported under ``TYPE_CHECKING``) fits anything there; a union fits when one
of its members does; a class fits its subclasses and its bases.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final

from pipeline import Context, Engine, Stream

__all__ = ("Declared", "declared", "describe", "fits", "mismatches")

#: what ``generate`` may say it returns, each read as a stream of its first argument
_STREAMS: Final = frozenset(
    {
        Stream,
        collections.abc.AsyncIterator,
        collections.abc.AsyncGenerator,
        collections.abc.AsyncIterable,
    }
)


@dataclass(frozen=True, slots=True)
class Declared:
    """The types an operator's ``generate`` declares (None: not declared, or unreadable)."""

    #: what ``ctx.data`` is: ``Context[request]``
    request: Any = None
    #: what it yields: ``Stream[output]``
    output: Any = None
    #: what it sends downstream: ``Engine[downstream_request, ...]``
    downstream_request: Any = None
    #: what downstream yields to it: ``Engine[..., downstream_output]``
    downstream_output: Any = None


def declared(operator: object) -> Declared:
    """The types ``operator.generate`` declares (all None when it has no readable ones)."""
    generate = getattr(operator, "generate", None)
    function = getattr(generate, "__func__", generate)
    if function is None or not hasattr(function, "__annotations__"):
        return Declared()
    try:
        return _declared(function)
    except TypeError:  # unhashable: a callable object, not a function
        return Declared()


def fits(declared_type: Any, offered: Any) -> bool:
    """False only when ``declared_type`` and ``offered`` are classes (or unions of
    classes) no member of which is a subclass or a base of a member of the other."""
    if declared_type is None:
        return True
    mine, theirs = _classes(declared_type), _classes(offered)
    if mine is None or theirs is None:
        return True
    try:
        return any(issubclass(a, b) or issubclass(b, a) for a in mine for b in theirs)
    except TypeError:  # a class issubclass cannot judge (a non-runtime Protocol)
        return True


def mismatches(
    operator: object,
    request: Any,
    output: Any,
    downstream_request: Any,
    downstream_output: Any,
) -> list[str]:
    """What of ``operator``'s declared types does not fit a place where it gets
    ``request``, yields ``output``, and has a downstream taking ``downstream_request`` and
    yielding ``downstream_output``: phrases like ``"yields BackendOutput, not
    EngineOutput"`` (empty: it fits, as far as its annotations tell)."""
    found = declared(operator)
    checks = (
        ("takes", found.request, request),
        ("yields", found.output, output),
        ("sends downstream", found.downstream_request, downstream_request),
        ("expects from downstream", found.downstream_output, downstream_output),
    )
    return [
        f"{verb} {describe(mine)}, not {describe(theirs)}"
        for verb, mine, theirs in checks
        if not fits(mine, theirs)
    ]


def describe(annotation: Any) -> str:
    """A type as a reader writes it: ``BackendOutput``, ``ChatCompletionRequest | ...``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(describe(member) for member in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) or repr(annotation)


@functools.lru_cache(maxsize=256)
def _declared(function: Any) -> Declared:
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return Declared()
    if parameters and parameters[0] in ("self", "cls"):
        parameters = parameters[1:]
    ctx = _annotation(function, parameters[0]) if parameters else None
    downstream = _annotation(function, parameters[1]) if len(parameters) > 1 else None
    returns = _annotation(function, "return")
    down = _arguments(downstream, {Engine}, 2)
    return Declared(
        request=_arguments(ctx, {Context}, 1)[0],
        output=_arguments(returns, _STREAMS, 1)[0],
        downstream_request=down[0],
        downstream_output=down[1],
    )


def _annotation(function: Any, name: str) -> Any:
    """``function``'s annotation of ``name``, resolved as ``typing.get_type_hints`` does,
    alone: another annotation that does not resolve (a ``TYPE_CHECKING`` import) does not
    hide this one. None: absent, or it does not resolve either."""
    raw = function.__annotations__.get(name)
    if not isinstance(raw, str):
        return raw
    holder = types.SimpleNamespace(__annotations__={name: raw})
    scope = getattr(function, "__globals__", None)
    try:
        return typing.get_type_hints(holder, globalns=scope)[name]
    except Exception:  # NameError, SyntaxError, ...: not readable at run time
        return None


def _arguments(annotation: Any, origins: Collection[Any], count: int) -> tuple[Any, ...]:
    """The ``count`` type arguments of ``annotation`` when it is one of ``origins``
    parametrized (``Context[X]`` -> ``(X,)``), else Nones."""
    if typing.get_origin(annotation) in origins:
        arguments = typing.get_args(annotation)
        if len(arguments) >= count:
            return arguments[:count]
    return (None,) * count


def _classes(annotation: Any) -> tuple[type, ...] | None:
    """The classes ``annotation`` is (several for a union); None when it is anything else
    (``Any``, a type variable, a generic alias): then nothing can be judged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members: tuple[Any, ...] = typing.get_args(annotation)
    else:
        members = (annotation,)
    if all(isinstance(member, type) and member is not Any for member in members):
        return members
    return None  # (Any is a class since Python 3.11: it is said here that it judges nothing)
