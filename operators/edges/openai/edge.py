"""The OpenAI edge's routes: chat completions, completions, models, embeddings, tokenize.

::

    POST /v1/chat/completions   parse_chat_request        --[graph]--> events -> OpenAIReply
    POST /v1/completions        parse_completion_request  --[graph]--> events -> OpenAIReply
    GET  /v1/models, /v1/models/{model}   every model served that the key may use
                                (adapters with their ``parent``)
    POST /v1/embeddings         the engine's ``embed`` (:mod:`.embeddings`)
    POST /tokenize, /detokenize vLLM's shapes, through the preprocessor (:mod:`.tokenize`)

This is the whole of an edge: how each body becomes what the graph takes, and which
:class:`~.reply.OpenAIReply` renders the graph's events; the request's model (its graph),
admission, deadlines, request ids, disconnects, the drain and the metrics are
:mod:`operators.edges.http`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, final

import orjson

from operators.edges.http.asgi import send_json
from operators.edges.http.failures import Refusal
from operators.edges.http.routes import (
    Call,
    Exchange,
    Handler,
    Host,
    Route,
    resolve_model,
    visible_models,
)

from .errors import OPENAI_ERRORS
from .protocol import parse_chat_request, parse_completion_request
from .reply import OpenAIReply

if TYPE_CHECKING:
    from collections.abc import Callable

    from .preprocessor import OpenAIRequest

__all__ = ("CHAT_COMPLETIONS", "COMPLETIONS", "OpenAIEdge")

CHAT_COMPLETIONS: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
_POST: Final = frozenset({"POST"})
_GET: Final = frozenset({"GET"})


@final
class OpenAIEdge:
    """OpenAI's chat completions and completions (and models) over the app's graph.

    ``extra_routes`` are more OpenAI-shaped routes (embeddings, tokenize) built per host.
    """

    def __init__(self, *extra_routes: Callable[[Host], list[Route]]) -> None:
        self._extra = extra_routes

    def routes(self, host: Host) -> list[Route]:
        """The OpenAI routes on ``host``."""

        def generation(parse: Callable[[bytes], OpenAIRequest], path: str) -> Handler:
            async def handle(call: Call) -> int:
                async def prepare(body: bytes) -> Exchange:
                    request = await host.offload(len(body), parse, body)
                    model = resolve_model(call, request.model, host)
                    return Exchange(
                        request,
                        request.stream,
                        OpenAIReply(request),
                        graph=model.graph,
                        model=model.name,
                    )

                return await host.generate(call, prepare, OPENAI_ERRORS, route=path)

            return handle

        async def models(call: Call) -> int:
            cards = [model.card() for model in visible_models(call, host)]
            await send_json(call.send, 200, orjson.dumps({"object": "list", "data": cards}))
            return 200

        async def model(call: Call) -> int:
            try:
                found = resolve_model(call, call.params["model"], host)
            except Refusal as exc:
                rendered = OPENAI_ERRORS.render(exc.error)
                await send_json(call.send, rendered.status, rendered.body)
                return rendered.status
            await send_json(call.send, 200, orjson.dumps(found.card()))
            return 200

        routes = [
            Route(
                CHAT_COMPLETIONS,
                _POST,
                generation(parse_chat_request, CHAT_COMPLETIONS),
                OPENAI_ERRORS,
            ),
            Route(
                COMPLETIONS, _POST, generation(parse_completion_request, COMPLETIONS), OPENAI_ERRORS
            ),
            Route("/v1/models", _GET, models, OPENAI_ERRORS),
            Route("/v1/models/{model}", _GET, model, OPENAI_ERRORS, label="/v1/models"),
        ]
        for extra in self._extra:
            routes.extend(extra(host))
        return routes
