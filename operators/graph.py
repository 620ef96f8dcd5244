"""The default serving graph: what ``llm-pipeline serve`` runs behind its HTTP edge.

::

    OpenAI request -> [preprocessor] -> [parser] -> [migration] -> [backend]
                   -> [encoder_router] -> [prefill_router] -> engine
                      (one engine, or a Router over decode workers)

Backward, every operator sees the engine's outputs on their way out:

* the preprocessor renders and tokenizes the request and turns text into OpenAI chunks;
* the parser moves reasoning and tool calls out of the text (:mod:`operators.parsers`;
  above Migration, so it sees each token once whatever worker produced it);
* Migration retries on another worker when one is lost mid-stream;
* the Backend detokenizes and enforces stop conditions (its state lives in the Context, so
  Migration's retries resume it);
* the EncoderRouter runs image requests on an encode worker first, when there are any;
* the PrefillRouter runs the prompt on a prefill worker first, when there are any.

An engine that does not declare constrained decoding or reasoning budgets
(``engine.features``) gets a :class:`~operators.contracts.constraint_guard.ConstraintGuard` in
front of it: a request with ``response_format``, a required tool call or a reasoning budget
is then a 400 naming the field, not an answer that ignored it.

The graph is a value before it is an engine: :func:`default_stages` gives the six named
stages (:class:`Stages`), which a user splices (``insert_before``/``insert_after`` a named
stage, or ``dataclasses.replace`` one) and then links to an engine. :func:`default_graph`
is that in one call, with ``before={stage: [operators]}``; ``build_app`` and the CLI build
their graphs through it, so an extended graph is served exactly like the default one.

What an inserted operator sees depends on where it sits (its type says which):

==============================================  ==================  ===================
where                                           forward (request)   backward (outputs)
==============================================  ==================  ===================
before ``preprocessor``                        OpenAIRequest       OpenAIEvent
before ``parser`` / ``migration`` / ``backend`` PreprocessedRequest BackendOutput
before ``encoder_router`` / ``prefill_router``
/ ``engine``                                    PreprocessedRequest EngineOutput
==============================================  ==================  ===================

An operator between Migration and the Backend is inside the retry loop: a lost worker
restarts it with a child context, so whatever it keeps per request belongs in
``ctx.state`` (as the Backend's does), not in locals.

mypy checks those types where it sees the code; a ``Stages`` value checks them again when
it is made, from each operator's ``generate`` annotations (:mod:`operators.placement`), so
an operator in the wrong place (a text operator before the engine, from a
``--insert-before`` flag or untyped code) is a :class:`~pipeline.LinkError` naming the
stage and the operator, not a 500 on the first request. Unannotated operators pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, TypedDict, Unpack, cast, get_args, overload

from pipeline import Engine, LinkError, Operator, chain, link, named

from .backend import Backend
from .contracts.constraint_guard import GUARDED, ConstraintGuard, engine_name
from .contracts.llm import (
    BackendOutput,
    EngineOutput,
    PreprocessedRequest,
    engine_features,
)
from .edges.openai.events import OpenAIEvent
from .edges.openai.preprocessor import OpenAIPreprocessor, OpenAIRequest
from .migration import Migration, MigrationEvent
from .parsers import OutputParsers, ReasoningFormat, ToolCallFormat
from .parsers import reasoning_parser as registered_reasoning
from .parsers import tool_parser as registered_tools
from .placement import mismatches
from .routing.encoder_router import EncoderRouter
from .routing.prefill_router import PrefillRouter

if TYPE_CHECKING:
    from pipeline import RoutingPolicy, WorkerSet

    from .edges.openai.images import ImagePolicy
    from .text.tokenizer import Tokenizer

__all__ = (
    "POINTS",
    "STAGES",
    "GraphOptions",
    "OpenAIOperator",
    "Point",
    "Stage",
    "Stages",
    "TextOperator",
    "TokenOperator",
    "check_insertion",
    "default_graph",
    "default_stages",
)

Stage = Literal[
    "preprocessor", "parser", "migration", "backend", "encoder_router", "prefill_router"
]
"""The names of the default graph's stages, front to back."""
Point = Stage | Literal["engine"]
"""Where operators can be inserted *before*: a stage, or the engine."""
#: the stages in order, front to back
STAGES: Final[tuple[Stage, ...]] = get_args(Stage)
#: the insertion points in order: every stage, then the engine
POINTS: Final[tuple[Point, ...]] = (*STAGES, "engine")

OpenAIOperator = Operator[OpenAIRequest, OpenAIEvent, OpenAIRequest, OpenAIEvent]
"""An operator in front of the preprocessor: OpenAI requests in, OpenAI events out."""
TextOperator = Operator[PreprocessedRequest, BackendOutput, PreprocessedRequest, BackendOutput]
"""An operator between the preprocessor and the Backend: token requests, detokenized output."""
TokenOperator = Operator[PreprocessedRequest, EngineOutput, PreprocessedRequest, EngineOutput]
"""An operator between the Backend and the engine: token requests, raw engine output."""

_AnyOperator = Operator[Any, Any, Any, Any]

_OPENAI: Final = (OpenAIRequest, OpenAIEvent)
_TEXT: Final = (PreprocessedRequest, BackendOutput)
_TOKENS: Final = (PreprocessedRequest, EngineOutput)
#: what flows at each point: the requests an operator there gets and the outputs it yields
#: (the types of :data:`OpenAIOperator`, :data:`TextOperator`, :data:`TokenOperator`)
_FLOWS: Final[Mapping[Point, tuple[Any, Any]]] = {
    "preprocessor": _OPENAI,
    "parser": _TEXT,
    "migration": _TEXT,
    "backend": _TEXT,
    "encoder_router": _TOKENS,
    "prefill_router": _TOKENS,
    "engine": _TOKENS,
}


class GraphOptions(TypedDict, total=False):
    """The optional settings of :func:`default_stages` (and so of ``default_graph`` and
    ``build_app``), as a type for ``**options``."""

    max_model_len: int | None
    default_max_tokens: int | None
    chat_template: str | None
    migration_limit: int
    on_migration: MigrationEvent | None
    encode_workers: WorkerSet[PreprocessedRequest, EngineOutput] | None
    prefill_workers: WorkerSet[PreprocessedRequest, EngineOutput] | None
    prefill_policy: RoutingPolicy | None
    disagg_min_prompt_tokens: int
    images: ImagePolicy | None
    tool_call_parser: str | ToolCallFormat | None
    reasoning_parser: str | ReasoningFormat | None
    engine_features: frozenset[str] | None
    adapters: Container[str]


def _check_point(name: str, valid: Sequence[str], where: str) -> None:
    if name not in valid:
        raise ValueError(
            f"cannot insert {where} {name!r}: the default graph's points are "
            + ", ".join(repr(v) for v in valid)
        )


@dataclass(frozen=True)
class Stages:
    """The default graph without its engine: six named stages and what was inserted.

    A value: every method returns a new ``Stages`` and leaves this one as it was, so one
    ``Stages`` can be extended two ways or linked to several engines. Replace a stage
    with ``dataclasses.replace(stages, backend=MyBackend(...))``.
    """

    preprocessor: Operator[OpenAIRequest, OpenAIEvent, PreprocessedRequest, BackendOutput]
    parser: TextOperator
    migration: TextOperator
    backend: Operator[PreprocessedRequest, BackendOutput, PreprocessedRequest, EngineOutput]
    encoder_router: TokenOperator
    prefill_router: TokenOperator
    #: operators inserted before each point, front to back
    before: Mapping[Point, tuple[_AnyOperator, ...]] = field(default_factory=dict)
    #: what the engine supports (None: what ``link``'s engine declares, ``engine.features``);
    #: without constrained decoding or reasoning budgets a ConstraintGuard refuses the
    #: requests that ask for them
    engine_features: frozenset[str] | None = None

    def __post_init__(self) -> None:
        """Refuse an operator whose ``generate`` annotations do not fit its place.

        Raises:
            LinkError: naming the stage (or point) and the operator, what does not fit,
                and for an inserted operator the points where it would.
            ValueError: a key of ``before`` is not one of :data:`POINTS`.
        """
        for position, name in enumerate(STAGES):
            stage = getattr(self, name)
            problems = mismatches(stage, *_FLOWS[name], *_FLOWS[POINTS[position + 1]])
            if problems:
                raise LinkError(
                    f"{type(stage).__name__} cannot be the {name!r} stage: its generate "
                    + "; ".join(problems)
                )
        for point, ops in self.before.items():
            for op in ops:
                check_insertion(point, op)

    @overload
    def insert_before(self, name: Literal["preprocessor"], *ops: OpenAIOperator) -> Stages: ...
    @overload
    def insert_before(
        self, name: Literal["parser", "migration", "backend"], *ops: TextOperator
    ) -> Stages: ...
    @overload
    def insert_before(
        self, name: Literal["encoder_router", "prefill_router", "engine"], *ops: TokenOperator
    ) -> Stages: ...
    def insert_before(self, name: Point, *ops: _AnyOperator) -> Stages:
        """These stages with ``ops`` (front to back) just before stage ``name`` (or the
        engine); after anything inserted there before.

        Raises:
            ValueError: ``name`` is not one of :data:`POINTS`.
            LinkError: an operator's ``generate`` annotations do not fit there
                (:func:`check_insertion`).
        """
        _check_point(name, POINTS, "before")
        before = dict(self.before)
        before[name] = (*before.get(name, ()), *ops)
        return dataclasses.replace(self, before=before)

    @overload
    def insert_after(
        self, name: Literal["preprocessor", "parser", "migration"], *ops: TextOperator
    ) -> Stages: ...
    @overload
    def insert_after(
        self, name: Literal["backend", "encoder_router", "prefill_router"], *ops: TokenOperator
    ) -> Stages: ...
    def insert_after(self, name: Stage, *ops: _AnyOperator) -> Stages:
        """These stages with ``ops`` (front to back) just after stage ``name``; before
        anything inserted there before.

        Raises:
            ValueError: ``name`` is not one of :data:`STAGES`.
            LinkError: an operator's ``generate`` annotations do not fit there.
        """
        _check_point(name, STAGES, "after")
        following = POINTS[STAGES.index(name) + 1]
        before = dict(self.before)
        before[following] = (*ops, *before.get(following, ()))
        return dataclasses.replace(self, before=before)

    def insert(self, before: Mapping[Point, Sequence[_AnyOperator]]) -> Stages:
        """These stages with ``before[name]`` inserted before each ``name``.

        Raises:
            ValueError: a key is not one of :data:`POINTS`.
        """
        stages = self
        for name, ops in before.items():
            stages = cast(Any, stages).insert_before(name, *ops)
        return stages

    def __iter__(self) -> Iterator[_AnyOperator]:
        """Every operator, front to back, inserted ones included (the engine excluded)."""
        for name in STAGES:
            yield from self.before.get(name, ())
            yield getattr(self, name)
        yield from self.before.get("engine", ())

    def link(
        self, engine: Engine[PreprocessedRequest, EngineOutput]
    ) -> Engine[OpenAIRequest, OpenAIEvent]:
        """The graph: every operator linked, front to back, onto ``engine``.

        Each stage is :func:`pipeline.named` after its field, so a traced request's spans
        say ``preprocessor``, ``migration``, ... (an inserted operator's, its class name).
        Each point's inserted operators are one :func:`pipeline.chain` (spliced in place by
        ``link``, so an empty point costs nothing), which keeps the link typed stage by
        stage (``link(*self, engine)`` would not type-check). Eleven operators are more
        than one ``link`` call types, so the routers' end is linked first: ``link`` folds
        to the right anyway, so the nesting builds the same chain as one flat call.
        """
        at = self.before.get
        return link(
            chain(*at("preprocessor", ())),
            named("preprocessor", self.preprocessor),
            chain(*at("parser", ())),
            named("parser", self.parser),
            self.link_tokens(engine),
        )

    def link_tokens(
        self, engine: Engine[PreprocessedRequest, EngineOutput]
    ) -> Engine[PreprocessedRequest, BackendOutput]:
        """The graph below the parser: token requests in, the Backend's outputs out
        (Migration, the Backend's stop rules on ids and text, the routers, the engine, and
        what was inserted there). What the tokens-in/tokens-out edge serves: no template, no
        tokenizing, no parsing of the text."""
        at = self.before.get
        features = self.engine_features
        if features is None:
            features = engine_features(engine)
        guard = (
            chain()
            if GUARDED <= features
            else chain(ConstraintGuard(engine_name(engine), features=features))
        )
        routers = link(
            chain(*at("encoder_router", ())),
            named("encoder_router", self.encoder_router),
            chain(*at("prefill_router", ())),
            named("prefill_router", self.prefill_router),
            chain(*at("engine", ())),
            guard,
            engine,
        )
        return link(
            chain(*at("migration", ())),
            named("migration", self.migration),
            chain(*at("backend", ())),
            named("backend", self.backend),
            routers,
        )


def check_insertion(point: Point, op: object) -> None:
    """Check that ``op`` fits just before ``point``, as far as its ``generate``
    annotations tell (:mod:`operators.placement`; an unannotated operator fits).

    Raises:
        ValueError: ``point`` is not one of :data:`POINTS`.
        LinkError: it does not fit; the message names the operator, the point, what does
            not fit and the points where it would.
    """
    _check_point(point, POINTS, "before")
    problems = mismatches(op, *_FLOWS[point], *_FLOWS[point])
    if not problems:
        return
    message = f"{type(op).__name__} cannot go before {point!r}: its generate "
    message += "; ".join(problems)
    fitting = [other for other in POINTS if not mismatches(op, *_FLOWS[other], *_FLOWS[other])]
    if fitting:
        message += " (it fits before " + ", ".join(repr(other) for other in fitting) + ")"
    raise LinkError(message)


def default_stages(
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_model_len: int | None = None,
    default_max_tokens: int | None = None,
    chat_template: str | None = None,
    migration_limit: int = 3,
    on_migration: MigrationEvent | None = None,
    encode_workers: WorkerSet[PreprocessedRequest, EngineOutput] | None = None,
    prefill_workers: WorkerSet[PreprocessedRequest, EngineOutput] | None = None,
    prefill_policy: RoutingPolicy | None = None,
    disagg_min_prompt_tokens: int = 0,
    images: ImagePolicy | None = None,
    tool_call_parser: str | ToolCallFormat | None = "hermes",
    reasoning_parser: str | ReasoningFormat | None = None,
    engine_features: frozenset[str] | None = None,
    adapters: Container[str] = frozenset(),
) -> Stages:
    """The default graph's stages, all sharing ``tokenizer``, ready to splice and link.

    ``model_name`` is reported in responses; ``max_model_len`` bounds prompt plus output
    (and stops migrating a request that outgrew it); ``default_max_tokens`` applies when a
    request sets no limit; ``chat_template`` (Jinja source) overrides the tokenizer's;
    ``migration_limit`` is the retries per request (0 disables); ``on_migration`` hears of
    each lost worker; ``encode_workers``/``prefill_workers`` turn on the encoder hop and
    disaggregated prefill (for prompts of at least ``disagg_min_prompt_tokens``), the
    prefill worker picked by ``prefill_policy`` (default round-robin; e.g. a
    :class:`pipeline.KvRouter`); ``images`` says which image inputs are accepted;
    ``tool_call_parser`` and ``reasoning_parser`` are formats or their registered names
    (:mod:`operators.parsers`; None: no parsing, and requests with tools get a 400);
    ``engine_features`` overrides what the engine declares (a Router over workers that
    check constraints themselves); ``adapters`` names the engine's adapters (LoRA: a live
    set, read per request), which requests may name as their model.

    Raises:
        ValueError: a parser name is not registered.
    """
    tools = (
        registered_tools(tool_call_parser)
        if isinstance(tool_call_parser, str)
        else tool_call_parser
    )
    reasoning = reasoning_parser
    if isinstance(reasoning, str):
        reasoning = registered_reasoning(reasoning)
    return Stages(
        preprocessor=OpenAIPreprocessor(
            tokenizer,
            model_name=model_name,
            max_model_len=max_model_len,
            default_max_tokens=default_max_tokens,
            chat_template=chat_template,
            images=images,
            tool_format=tools,
            adapters=adapters,
            reasoning=reasoning,
        ),
        parser=OutputParsers(tools, reasoning),
        migration=Migration(migration_limit, max_seq_len=max_model_len, on_event=on_migration),
        backend=Backend(tokenizer),
        encoder_router=EncoderRouter(encode_workers),
        prefill_router=PrefillRouter(
            prefill_workers, min_prompt_tokens=disagg_min_prompt_tokens, policy=prefill_policy
        ),
        engine_features=engine_features,
    )


def default_graph(
    engine: Engine[PreprocessedRequest, EngineOutput],
    tokenizer: Tokenizer,
    *,
    model_name: str,
    before: Mapping[Point, Sequence[_AnyOperator]] | None = None,
    **options: Unpack[GraphOptions],
) -> Engine[OpenAIRequest, OpenAIEvent]:
    """The full default graph around ``engine``, all sharing ``tokenizer``.

    ``before`` inserts operators before named stages (or the engine), e.g.
    ``before={"backend": [Redact()]}``; ``options`` are :func:`default_stages`'s.

    Raises:
        ValueError: a key of ``before`` is not one of :data:`POINTS`.
        LinkError: an inserted operator's ``generate`` annotations do not fit its place
            (:func:`check_insertion`).
    """
    stages = default_stages(tokenizer, model_name=model_name, **options)
    return stages.insert(before or {}).link(engine)
