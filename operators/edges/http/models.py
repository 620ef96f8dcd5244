"""The models an app serves, by name: :class:`Models`, the one place a request's ``model``
field is routed.

Every edge routes alike: its request names a model (or none: the default one, the first
served), :meth:`Models.resolve` answers with that model's :class:`ServedModel` (its graph,
and what the OpenAI-shaped routes need beside it: its preprocessor, its embedder) or
refuses: an unknown name is a 404 naming ``model`` (OpenAI's ``model_not_found``; each
edge's :class:`~.failures.ErrorStyle` says it in its own words). ::

    request.model --> Models.resolve --> ServedModel(name, graph, parent, ...)
                                         |-> Exchange(graph=..., model=name)  (generations)
                                         |-> preprocessor / embedder          (tokenize, embed)

The set may change while the app serves (``serve --nats`` follows the models workers
register; adapters are loaded and unloaded at run time): a request keeps the model it
resolved, later ones see the new set. An adapter (LoRA) is a model of its own name whose
``parent`` is its base model: it usually runs on its parent's graph, which tells the engine
which adapter to apply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, final

from .failures import ApiError, Refusal, unknown_model

if TYPE_CHECKING:
    from operators.contracts.llm import Embedder, LoraEngine
    from pipeline import Engine

__all__ = ("Models", "ServedModel")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedModel:
    """One model an app serves: its name, its graph, and what the routes beside the graph
    need of it."""

    name: str
    #: what its generation requests run on
    graph: Engine[Any, Any]
    #: the base model's name when this is an adapter of it (None: a base model)
    parent: str | None = None
    #: where it was loaded from (a model file, an adapter file; None: its name)
    root: str | None = None
    #: the graph's own preprocessor (an ``OpenAIPreprocessor``): tokenize, count_tokens
    #: and embeddings render and encode through it (None: those routes refuse the model)
    preprocessor: Any = None
    #: what ``/v1/embeddings`` calls (None: the model does not embed)
    embedder: Embedder | None = None
    #: the engine's context length, for a preprocessor that sets none
    context: int | None = None
    #: its graph below the preprocessor (token requests in, the Backend's outputs out):
    #: what the tokens-in/tokens-out edge runs (None: that edge refuses the model)
    tokens: Engine[Any, Any] | None = None
    #: what loads and unloads its adapters (an engine declaring ``LORA``: a
    #: :class:`~operators.contracts.llm.LoraEngine`); None: it takes none
    lora: LoraEngine | None = None
    #: when it was added (seconds since the epoch), as its model card says
    created: int = field(default_factory=lambda: int(time.time()))

    def adapter(self, name: str, root: str) -> ServedModel:
        """The model an adapter of this one, loaded from ``root``, is served as: this
        model's graph (which tells the engine the adapter by the request's model name)."""
        return ServedModel(
            name=name,
            graph=self.graph,
            parent=self.name,
            root=root,
            preprocessor=self.preprocessor,
            context=self.context,
            tokens=self.tokens,
        )

    def card(self) -> dict[str, Any]:
        """Its entry in ``GET /v1/models`` (OpenAI's model object, with vLLM's ``root`` and
        ``parent``)."""
        card: dict[str, Any] = {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "llm-pipeline",
            "root": self.root if self.root is not None else self.name,
            "parent": self.parent,
        }
        context = getattr(self.preprocessor, "max_model_len", None) or self.context
        if isinstance(context, int):  # (vLLM's field: what a client must fit in)
            card["max_model_len"] = context
        return card


@final
class Models:
    """The models an app serves, in the order they were added; the first is the default
    (what a request naming no model gets)."""

    __slots__ = ("_models",)

    def __init__(self, models: Iterable[ServedModel] = ()) -> None:
        self._models: dict[str, ServedModel] = {}
        for model in models:
            self.add(model)

    def add(self, model: ServedModel) -> None:
        """Serve ``model`` (replacing the one of that name, which keeps its place)."""
        self._models[model.name] = model

    def remove(self, name: str) -> ServedModel | None:
        """Stop serving ``name`` (requests already running on it go on); what it was."""
        return self._models.pop(name, None)

    def get(self, name: str) -> ServedModel | None:
        """The model called ``name``, or None."""
        return self._models.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        """The names served, in order."""
        return tuple(self._models)

    @property
    def default(self) -> ServedModel | None:
        """What a request naming no model gets: the first model (None: none served)."""
        return next(iter(self._models.values()), None)

    def adapters_of(self, name: str) -> list[ServedModel]:
        """The adapters served whose parent is ``name``."""
        return [model for model in self._models.values() if model.parent == name]

    def resolve(
        self, name: str | None, allowed: Callable[[str], bool] | None = None
    ) -> ServedModel:
        """The model a request naming ``name`` runs on (None: the default one), among the
        models ``allowed`` lets it use (None: any): a model it may not use is refused as
        one that is not served, naming only the models it may use.

        Raises:
            Refusal: ``not_found`` naming ``model`` (code ``model_not_found``) for a name
                not served (or none, when ``allowed`` allows no model served); ``unavailable``
                when the request names none and no model is served now.
        """
        if name is None:
            model = self.default
            if model is not None and allowed is not None and not allowed(model.name):
                model = next((m for m in self._models.values() if allowed(m.name)), None)
                if model is None:
                    raise Refusal(unknown_model("(none named)", ()))
            if model is None:
                raise Refusal(ApiError("unavailable", "No model is served now; retry later."))
            return model
        model = self._models.get(name)
        if model is None or (allowed is not None and not allowed(name)):
            names = self.names if allowed is None else [n for n in self.names if allowed(n)]
            raise Refusal(unknown_model(name, names))
        return model

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(tuple(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __repr__(self) -> str:
        return f"Models({list(self._models)})"
