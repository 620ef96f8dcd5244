"""Composing operators onto an engine: :func:`link`.

``link(a, b, engine)`` is a right fold: the result is an Engine whose ``generate(ctx)`` is
``a.generate(ctx, <b linked to engine>)``. No task, queue or copy sits between stages; the
only thing a link adds is bookkeeping of the downstream streams an operator opened, so that
when the caller closes the stream early every generator down to the engine is closed too,
in order, in the caller's task, even if the operator's author never wrote ``aclosing``.
An operator that returns downstream's own stream (a passthrough) gets it back unwrapped.

Composition is typed: every adjacent pair must fit (operator K's downstream types are
stage K+1's own), checked by overloads up to ten operators and by nesting beyond that;
``docs/design.md`` ("Typed composition") says why overloads and not a builder.

Tracing is the link's job too, so that every operator is traced without code of its own:
a request whose Context carries a span (:mod:`pipeline.tracing`) gets a child span per
linked operator, named after its class or the name given with :func:`named`, and one
named ``"engine"`` for the engine below the last operator. The check is one attribute
read per stage and request; an untraced request runs exactly the code it always ran.
Traced, a span ends when its stream is closed, with no extra hop per item except where the
untraced link had none to piggyback on (the engine's stream, and a passthrough's).
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any, Final, TypeVar, final, overload

from .errors import LinkError

if TYPE_CHECKING:
    from .context import Context
    from .operator import Engine, Operator, Stream
    from .tracing import Span

__all__ = ("ENGINE_SPAN", "chain", "link", "named")

#: the name of the span of the engine at the bottom of a traced graph
ENGINE_SPAN: Final = "engine"
#: the attribute naming the class behind a stage's or the engine's span
OPERATOR_ATTRIBUTE: Final = "llm_pipeline.operator"

T = TypeVar("T")
# Req{k}/Item{k}: the request and item types on the edge below operator k (0: the graph's
# own), so mypy's "cannot infer Item2" points at the edge between operators 2 and 3.
Req0 = TypeVar("Req0")
Item0 = TypeVar("Item0")
Req1 = TypeVar("Req1")
Item1 = TypeVar("Item1")
Req2 = TypeVar("Req2")
Item2 = TypeVar("Item2")
Req3 = TypeVar("Req3")
Item3 = TypeVar("Item3")
Req4 = TypeVar("Req4")
Item4 = TypeVar("Item4")
Req5 = TypeVar("Req5")
Item5 = TypeVar("Item5")
Req6 = TypeVar("Req6")
Item6 = TypeVar("Item6")
Req7 = TypeVar("Req7")
Item7 = TypeVar("Item7")
Req8 = TypeVar("Req8")
Item8 = TypeVar("Item8")
Req9 = TypeVar("Req9")
Item9 = TypeVar("Item9")
Req10 = TypeVar("Req10")
Item10 = TypeVar("Item10")


def _name(obj: object) -> str:
    return type(obj).__name__


def _positional_arity(method: Any) -> int | None:
    """How many positional arguments ``method`` takes, or None when it can't be told."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return None
    count = 0
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            count += 1
    return count


def _check_stage(stage: object, *, position: str, arity: int) -> None:
    if isinstance(stage, type):
        # A class has an (unbound) generate too, so say so before counting its parameters.
        raise LinkError(
            f"{position} is the class {stage.__name__}, not an instance of it; "
            f"did you mean {stage.__name__}()?"
        )
    generate = getattr(stage, "generate", None)
    if generate is None or not callable(generate):
        hint = ""
        if inspect.isasyncgenfunction(stage) or inspect.iscoroutinefunction(stage):
            hint = " It is a function; wrap it in pipeline.FunctionEngine(...) to use it."
        raise LinkError(f"{position} {stage!r} has no generate() method.{hint}")
    if inspect.iscoroutinefunction(generate):
        raise LinkError(
            f"{_name(stage)}.generate is a coroutine function (async def without yield); "
            "it must be an async generator. Did you forget to `yield`?"
        )
    found = _positional_arity(generate)
    if found is None or found == arity:
        return
    if arity == 1 and found == 2:
        raise LinkError(
            f"the last argument of link() must be an engine, but {_name(stage)}.generate "
            "takes (ctx, downstream) like an operator. Did you forget the engine?"
        )
    if arity == 2 and found == 1:
        raise LinkError(
            f"{position} {_name(stage)} looks like an engine (generate takes only ctx); "
            "only the last argument of link() may be an engine."
        )
    kind, params = ("engine", "(ctx)") if arity == 1 else ("operator", "(ctx, downstream)")
    raise LinkError(
        f"{_name(stage)}.generate takes {found} positional arguments; an {kind} takes {params}."
    )


def _as_stream(result: Stream[T], stage: object) -> Stream[T]:
    """``result`` itself, once it is seen to be a stream (a typed graph cannot be wrong
    here; an untyped one can, and should say how)."""
    if hasattr(result, "__anext__"):
        return result
    if inspect.iscoroutine(result):
        result.close()
        raise LinkError(
            f"{_name(stage)}.generate returned a coroutine, not an async iterator. "
            "Did you forget to `yield`?"
        )
    raise LinkError(
        f"{_name(stage)}.generate returned {type(result).__name__}, not an async iterator"
    )


class _Downstream:
    """What a linked operator sees as ``downstream``: records the streams it opens."""

    __slots__ = ("_engine", "opened")

    def __init__(self, engine: Engine[Any, Any]) -> None:
        self._engine = engine
        self.opened: list[Stream[Any]] = []

    def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        stream = _as_stream(self._engine.generate(ctx), self._engine)
        self.opened.append(stream)
        return stream


class _LinkedStream:
    """The stream of one operator call; closing it closes what the operator opened."""

    __slots__ = ("_downstream", "_stream")

    def __init__(self, stream: Stream[Any], downstream: _Downstream) -> None:
        self._stream = stream
        self._downstream = downstream

    def __aiter__(self) -> _LinkedStream:
        return self

    def __anext__(self) -> Any:
        # Return the awaitable itself: no extra coroutine frame per item.
        return self._stream.__anext__()

    def athrow(self, *args: Any) -> Any:
        return self._stream.athrow(*args)  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        try:
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            for opened in self._downstream.opened:
                aclose = getattr(opened, "aclose", None)
                if aclose is not None:
                    await aclose()


class _SpanStream:
    """A traced stream: closing it closes what it opened (as :class:`_LinkedStream`), then
    ends its spans (its own, and those of passthrough stages above that returned it)."""

    __slots__ = ("_next", "_opened", "_stream", "spans")

    def __init__(
        self, stream: Stream[Any], opened: list[Stream[Any]], span: Span, *, engine: bool = False
    ) -> None:
        self._stream = stream
        self._opened = opened
        self.spans = [span]
        self._next: Any = self._first if engine else stream.__anext__

    def __aiter__(self) -> _SpanStream:
        return self

    def __anext__(self) -> Any:
        return self._next()

    async def _first(self) -> Any:
        """The engine's first output: an event on its span (and an error before it)."""
        try:
            item = await self._stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            self.spans[0].set_error(f"{type(exc).__name__}: {exc}")
            raise
        self.spans[0].add_event("first_token")
        self._next = self._stream.__anext__
        return item

    def athrow(self, *args: Any) -> Any:
        return self._stream.athrow(*args)  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        try:
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            try:
                for opened in self._opened:
                    aclose = getattr(opened, "aclose", None)
                    if aclose is not None:
                        await aclose()
            finally:
                now = time.time_ns()
                for span in self.spans:
                    span.end(now)


class _TracedDownstream(_Downstream):
    """The downstream of a traced operator whose downstream is the engine: the engine's
    stream gets a span of its own."""

    __slots__ = ()

    def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        parent = ctx.span
        if parent is None:  # the operator passed on a context of its own making
            return super().generate(ctx)
        engine = self._engine
        span = parent.child(ENGINE_SPAN)
        span.set(OPERATOR_ATTRIBUTE, _name(engine))
        try:
            stream = _as_stream(engine.generate(ctx.with_span(span)), engine)
        except BaseException as exc:
            span.set_error(f"{type(exc).__name__}: {exc}")
            span.end()
            raise
        traced = _SpanStream(stream, [], span, engine=True)
        self.opened.append(traced)
        return traced


class _Linked:
    """An operator bound to its downstream: itself an Engine."""

    __slots__ = ("_downstream", "_leaf", "_name", "_operator")

    def __init__(
        self,
        operator: Operator[Any, Any, Any, Any],
        downstream: Engine[Any, Any],
        name: str | None = None,
    ):
        self._operator = operator
        self._downstream = downstream
        #: the name of this stage's span
        self._name = name if name is not None else _name(operator)
        #: whether ``downstream`` is the engine (it gets the engine's span)
        self._leaf = not isinstance(downstream, (_Linked, _Downstream))

    def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        if ctx.span is not None:
            return self._traced(ctx)
        downstream = _Downstream(self._downstream)
        stream = _as_stream(self._operator.generate(ctx, downstream), self._operator)
        opened = downstream.opened
        if len(opened) == 1 and opened[0] is stream:
            # The operator handed downstream's stream through: closing it closes all the
            # operator opened, so there is nothing to record and no hop to add.
            return stream
        return _LinkedStream(stream, downstream)

    def _traced(self, ctx: Context[Any]) -> Stream[Any]:
        """``generate`` for a traced request: the operator runs under a span of its own."""
        assert ctx.span is not None
        span = ctx.span.child(self._name)
        operator = self._operator
        span.set(OPERATOR_ATTRIBUTE, _name(operator))
        downstream = (
            _TracedDownstream(self._downstream) if self._leaf else _Downstream(self._downstream)
        )
        try:
            stream = _as_stream(operator.generate(ctx.with_span(span), downstream), operator)
        except BaseException as exc:
            span.set_error(f"{type(exc).__name__}: {exc}")
            span.end()
            raise
        opened = downstream.opened
        if len(opened) == 1 and opened[0] is stream and isinstance(stream, _SpanStream):
            # A passthrough: its span ends with the stream it handed through (no hop).
            stream.spans.append(span)
            return stream
        return _SpanStream(stream, opened, span)

    def __repr__(self) -> str:
        return f"link({self._operator!r}, {self._downstream!r})"


@overload
def link(engine: Engine[Req0, Item0], /) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    engine: Engine[Req1, Item1],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    engine: Engine[Req2, Item2],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    engine: Engine[Req3, Item3],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    op4: Operator[Req3, Item3, Req4, Item4],
    engine: Engine[Req4, Item4],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    op4: Operator[Req3, Item3, Req4, Item4],
    op5: Operator[Req4, Item4, Req5, Item5],
    engine: Engine[Req5, Item5],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    op4: Operator[Req3, Item3, Req4, Item4],
    op5: Operator[Req4, Item4, Req5, Item5],
    op6: Operator[Req5, Item5, Req6, Item6],
    engine: Engine[Req6, Item6],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    op4: Operator[Req3, Item3, Req4, Item4],
    op5: Operator[Req4, Item4, Req5, Item5],
    op6: Operator[Req5, Item5, Req6, Item6],
    op7: Operator[Req6, Item6, Req7, Item7],
    engine: Engine[Req7, Item7],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    op4: Operator[Req3, Item3, Req4, Item4],
    op5: Operator[Req4, Item4, Req5, Item5],
    op6: Operator[Req5, Item5, Req6, Item6],
    op7: Operator[Req6, Item6, Req7, Item7],
    op8: Operator[Req7, Item7, Req8, Item8],
    engine: Engine[Req8, Item8],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    op4: Operator[Req3, Item3, Req4, Item4],
    op5: Operator[Req4, Item4, Req5, Item5],
    op6: Operator[Req5, Item5, Req6, Item6],
    op7: Operator[Req6, Item6, Req7, Item7],
    op8: Operator[Req7, Item7, Req8, Item8],
    op9: Operator[Req8, Item8, Req9, Item9],
    engine: Engine[Req9, Item9],
    /,
) -> Engine[Req0, Item0]: ...
@overload
def link(
    op1: Operator[Req0, Item0, Req1, Item1],
    op2: Operator[Req1, Item1, Req2, Item2],
    op3: Operator[Req2, Item2, Req3, Item3],
    op4: Operator[Req3, Item3, Req4, Item4],
    op5: Operator[Req4, Item4, Req5, Item5],
    op6: Operator[Req5, Item5, Req6, Item6],
    op7: Operator[Req6, Item6, Req7, Item7],
    op8: Operator[Req7, Item7, Req8, Item8],
    op9: Operator[Req8, Item8, Req9, Item9],
    op10: Operator[Req9, Item9, Req10, Item10],
    engine: Engine[Req10, Item10],
    /,
) -> Engine[Req0, Item0]: ...
def link(*stages: Any) -> Engine[Any, Any]:
    """Fold ``operators`` onto the engine given last; the result is an Engine.

    Typed for up to ten operators: each one's downstream types must be the next stage's
    own, so a mis-ordered graph is a mypy error ("cannot infer value of type parameter
    ItemK": the items on the edge below operator K do not fit). There is deliberately no
    untyped fallback. Longer graphs nest, and stay typed, because the result is an Engine:
    ``link(a, b, link(c, d, engine))``; same-typed operators from a list compose with
    :func:`chain`.

    Raises:
        LinkError: when no engine is given, or a stage is not an operator or engine.
    """
    if not stages:
        raise LinkError("link() needs at least an engine")
    *operators, engine = stages
    _check_stage(engine, position="the engine", arity=1)
    for index, operator in enumerate(operators):
        _check_stage(operator, position=f"operator #{index + 1}", arity=2)
    linked: Engine[Any, Any] = engine
    for operator, name in reversed(_flatten(operators)):
        linked = _Linked(operator, linked, name)
    return linked


def chain(*operators: Operator[Req0, Item0, Req0, Item0]) -> Operator[Req0, Item0, Req0, Item0]:
    """Operators that take and yield the same types, composed into one operator.

    This is how a graph built from a list stays typed (``link(*ops, engine)`` is not):
    ``link(preprocessor, Migration(), chain(*extra), Backend(tok), engine)``. ``link``
    splices a chain's operators in place, so a chain costs nothing per item; ``chain()``
    is a passthrough.

    Raises:
        LinkError: when an argument is not an operator.
    """
    for index, operator in enumerate(operators):
        _check_stage(operator, position=f"chain() operator #{index + 1}", arity=2)
    return _Chain(_flatten(list(operators)))


def named(
    name: str, operator: Operator[Req0, Item0, Req1, Item1]
) -> Operator[Req0, Item0, Req1, Item1]:
    """``operator``, whose span in a traced request is called ``name`` instead of its
    class's name (the default graph names its stages so: ``"backend"``, ``"migration"``).

    ``link`` unwraps it like a :func:`chain`: it costs nothing per request or item.

    Raises:
        LinkError: when ``operator`` is not an operator, or ``name`` is empty.
    """
    if not name:
        raise LinkError("named() needs a non-empty name")
    _check_stage(operator, position=f"named({name!r}, ...) operator", arity=2)
    if isinstance(operator, _Chain):
        raise LinkError(f"named({name!r}, ...) names one operator, not a chain")
    return _Chain(((operator, name),))


def _flatten(operators: list[Any]) -> tuple[tuple[Any, str | None], ...]:
    """Each operator with its span name (None: its class's), chains spliced in."""
    flat: list[tuple[Any, str | None]] = []
    for operator in operators:
        if isinstance(operator, _Chain):
            flat.extend(operator.operators)
        else:
            flat.append((operator, None))
    return tuple(flat)


@final
class _Chain:
    """What :func:`chain` and :func:`named` return: an operator that links its operators
    per request (``link`` splices them in place instead)."""

    __slots__ = ("operators",)

    def __init__(self, operators: tuple[tuple[Operator[Any, Any, Any, Any], str | None], ...]):
        #: the operators, front to back, each with its span name (None: its class's)
        self.operators = operators

    def generate(self, ctx: Context[Any], downstream: Engine[Any, Any], /) -> Stream[Any]:
        """Serve ``ctx`` through the chained operators onto ``downstream``."""
        linked = downstream
        for operator, name in reversed(self.operators):
            linked = _Linked(operator, linked, name)
        return linked.generate(ctx)

    def __repr__(self) -> str:
        parts = (
            repr(op) if name is None else f"named({name!r}, {op!r})" for op, name in self.operators
        )
        return f"chain({', '.join(parts)})"
