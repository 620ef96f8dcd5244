"""Anthropic's Messages API routes: :class:`AnthropicEdge`.

::

    POST /v1/messages               MessagesRequest --[chat request]--> graph --> AnthropicReply
    POST /v1/messages/count_tokens  the same conversion, through the preprocessor only:
                                    {"input_tokens": the prompt tokens the message would use}
                                    (metered: a request of its key's requests per minute,
                                    none of its tokens)

Anthropic's clients send their key as ``x-api-key`` (the app's guard takes it as well as
``Authorization: Bearer``) and the API version as ``anthropic-version``; a version header
is not required here (peers accept requests without one), but a malformed one is a 400.
While a stream waits for its first token, a ``ping`` event is written every
:data:`PING_INTERVAL` seconds (Anthropic's keep-alive).
"""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Final, final

import orjson

from operators.edges.http.asgi import send_json
from operators.edges.http.failures import ApiError, Refusal, describe_failure, unknown_path
from operators.edges.http.routes import Call, Exchange, Host, KeepAlive, Route, resolve_model

from .conversation import chat_request
from .errors import ANTHROPIC_ERRORS
from .protocol import (
    CountTokensRequest,
    MessagesRequest,
    parse_count_tokens_request,
    parse_messages_request,
)
from .render import PING, MessageRenderer
from .reply import AnthropicReply

if TYPE_CHECKING:
    from operators.edges.openai.preprocessor import OpenAIPreprocessor
    from operators.edges.openai.protocol import ChatCompletionRequest

__all__ = ("COUNT_TOKENS", "MESSAGES", "PING_INTERVAL", "AnthropicEdge")

MESSAGES: Final = "/v1/messages"
COUNT_TOKENS: Final = "/v1/messages/count_tokens"
#: seconds a stream may stay quiet before a ping is written
PING_INTERVAL: Final = 5.0
_VERSION: Final = re.compile(rb"\d{4}-\d{2}-\d{2}")
_POST: Final = frozenset({"POST"})


def _check_version(call: Call) -> None:
    """Refuse a malformed ``anthropic-version`` header (a missing one is accepted)."""
    for name, value in call.scope.get("headers", ()):
        if name.lower() == b"anthropic-version" and not _VERSION.fullmatch(value.strip()):
            raise Refusal(
                ApiError(
                    "invalid_request",
                    f"anthropic-version: {value.decode('latin-1')!r} is not a version "
                    "(expected a date such as 2023-06-01)",
                    param="anthropic-version",
                )
            )


@final
class AnthropicEdge:
    """Anthropic's Messages API over the app's graph.

    ``count_tokens`` renders and encodes through the model's own preprocessor
    (:attr:`~operators.edges.http.models.ServedModel.preprocessor`), exactly as a message
    request would, or through ``preprocessor`` for a model that has none; without either
    it answers 404 as an unknown path.
    """

    def __init__(
        self,
        preprocessor: OpenAIPreprocessor | None = None,
        *,
        ping_interval: float = PING_INTERVAL,
    ) -> None:
        self._preprocessor = preprocessor
        self._keep_alive = KeepAlive(PING, ping_interval)

    def routes(self, host: Host) -> list[Route]:
        """The Messages routes on ``host``."""

        async def create(call: Call) -> int:
            async def prepare(body: bytes) -> Exchange:
                _check_version(call)
                request, chat = await host.offload(len(body), _parse_messages, body)
                model = resolve_model(call, request.model, host)
                renderer = MessageRenderer(
                    f"msg_{uuid.uuid4().hex}",
                    request.model,
                    stop_sequences=tuple(request.stop_sequences or ()),
                    stream=request.stream,
                )
                return Exchange(
                    chat,
                    request.stream,
                    AnthropicReply(renderer),
                    keep_alive=self._keep_alive if request.stream else None,
                    response_id=renderer.message_id,
                    graph=model.graph,
                    model=model.name,
                )

            return await host.generate(call, prepare, ANTHROPIC_ERRORS, route=MESSAGES)

        async def count_tokens(call: Call) -> int:
            try:
                body = await host.read_body(call)
                _check_version(call)
                request, chat = await host.offload(len(body), _parse_count_tokens, body)
                model = resolve_model(call, request.model, host)
                preprocessor = model.preprocessor or self._preprocessor
                if preprocessor is None:
                    raise Refusal(unknown_path(COUNT_TOKENS))
                legs = await preprocessor.prepare(chat)
            except Refusal as exc:
                error = exc.error
            except Exception as exc:  # InvalidRequest: the template, the context length
                error = describe_failure(exc, "(count_tokens)")
            else:
                count = sum(leg.prompt_tokens for leg in legs)
                await send_json(call.send, 200, orjson.dumps({"input_tokens": count}))
                return 200
            rendered = ANTHROPIC_ERRORS.render(error)
            await send_json(call.send, rendered.status, rendered.body, rendered.headers)
            return rendered.status

        return [
            Route(MESSAGES, _POST, create, ANTHROPIC_ERRORS),
            Route(COUNT_TOKENS, _POST, count_tokens, ANTHROPIC_ERRORS, metered=True),
        ]


def _parse_messages(body: bytes) -> tuple[MessagesRequest, ChatCompletionRequest]:
    """A Messages body and the chat request it becomes (linear in the turns: the edge runs
    it off the event loop for a large body)."""
    request = parse_messages_request(body)
    return request, chat_request(request, stream=request.stream)


def _parse_count_tokens(body: bytes) -> tuple[CountTokensRequest, ChatCompletionRequest]:
    """A count_tokens body and the chat request whose prompt it counts."""
    request = parse_count_tokens_request(body)
    return request, chat_request(request)
