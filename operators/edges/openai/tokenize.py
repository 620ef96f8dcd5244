"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes, through the preprocessor.

``/tokenize`` takes a ``prompt`` (``add_special_tokens``, default true, as a completions
prompt is encoded) or chat ``messages`` (and ``tools``), rendered with the chat template
exactly as a chat request would be (``add_generation_prompt``, default true), and answers
``{"count", "max_model_len", "tokens"}`` (plus ``token_strs`` with ``return_token_strs``).
The ids come from the preprocessor of the model's graph, so ``count`` is the
``usage.prompt_tokens`` of the same request. ``/detokenize`` takes ``{"tokens"}`` and
answers ``{"prompt"}``; an id outside the vocabulary is a 400 naming ``tokens``. A large
body is parsed, checked and decoded off the event loop (``host.offload``), as a large
prompt is rendered and encoded (the preprocessor's ``prepare``). Both are metered: each
counts against its key's requests per minute (not its tokens: nothing is generated).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import orjson
from pydantic import Field

from operators.edges.http.asgi import send_json
from operators.edges.http.failures import Refusal, describe_failure
from operators.edges.http.routes import Call, Host, Route, resolve_model
from operators.edges.http.schema import Bool, JsonObject, Model, TokenId, parse_body
from pipeline import InvalidRequest

from .errors import OPENAI_ERRORS
from .protocol import parse_chat_request, parse_completion_request

if TYPE_CHECKING:
    from .preprocessor import OpenAIPreprocessor, TokenizerLike

__all__ = ("DETOKENIZE", "TOKENIZE", "DetokenizeRequest", "TokenizeRequest", "tokenize_routes")

TOKENIZE: Final = "/tokenize"
DETOKENIZE: Final = "/detokenize"


class TokenizeRequest(Model):
    """The body of ``POST /tokenize``: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[JsonObject] | None = None
    tools: list[JsonObject] | None = None
    add_special_tokens: Bool | None = None
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(Model):
    """The body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId] = Field(min_length=0)


def _detokenized(tokenizer: TokenizerLike, tokens: list[int]) -> dict[str, Any]:
    """``/detokenize``'s answer (linear in the ids: run off the event loop when many).

    Raises:
        InvalidRequest: an id outside the vocabulary, naming ``tokens``.
    """
    vocab: int | None = getattr(tokenizer, "vocab_size", None)
    if vocab is not None:
        for position, token in enumerate(tokens):
            if token >= vocab:
                raise InvalidRequest(
                    f"tokens.{position}: token id {token} is outside the vocabulary (size {vocab})",
                    param="tokens",
                )
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}


def _token_strs(tokenizer: TokenizerLike, tokens: list[int]) -> list[str | None]:
    to_token = tokenizer.id_to_token
    return [to_token(token) for token in tokens]


def tokenize_routes(
    preprocessor: OpenAIPreprocessor | None = None, *, context: int | None = None
) -> Callable[[Host], list[Route]]:
    """The tokenize and detokenize routes, through each request's model's preprocessor
    (:class:`~operators.edges.http.models.ServedModel`), or ``preprocessor`` for a model
    that has none; ``context``: the engine's context length, reported as ``max_model_len``
    when neither the preprocessor nor the model knows one."""

    def through(call: Call, name: str | None, host: Host) -> tuple[OpenAIPreprocessor, Any]:
        """The preprocessor and ``max_model_len`` of the model ``name``."""
        model = resolve_model(call, name, host)
        own: OpenAIPreprocessor | None = model.preprocessor
        if own is None:
            own = preprocessor
            limit = context
        else:
            limit = model.context
        if own is None:
            raise InvalidRequest(
                f"the model {model.name!r} cannot tokenize (no preprocessor)", param="model"
            )
        return own, own.max_model_len or limit

    async def tokenize(call: Call, body: bytes, host: Host) -> dict[str, Any]:
        size = len(body)
        request = await host.offload(size, parse_body, TokenizeRequest, body)
        preprocessor, max_model_len = through(call, request.model, host)
        tokenizer = preprocessor.tokenizer
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequest("give either 'prompt' or 'messages'", param="prompt")
        if request.messages is not None:
            chat: dict[str, Any] = {"messages": request.messages}
            if request.tools is not None:
                chat["tools"] = request.tools
            if request.add_special_tokens:
                raise InvalidRequest(
                    "a chat prompt's special tokens come from its template: "
                    "'add_special_tokens' must be false with 'messages'",
                    param="add_special_tokens",
                )
            parsed = await host.offload(size, parse_chat_request, chat)
            [leg] = await preprocessor.prepare(
                parsed, add_generation_prompt=request.add_generation_prompt
            )
            tokens = leg.token_ids
        elif request.add_special_tokens is False:
            assert request.prompt is not None
            encode = partial(tokenizer.encode, add_special_tokens=False, parse_special=True)
            tokens = await host.offload(size, encode, request.prompt)
        else:
            [leg] = await preprocessor.prepare(parse_completion_request({"prompt": request.prompt}))
            tokens = leg.token_ids
        result: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": max_model_len,
            "tokens": tokens,
        }
        if request.return_token_strs:
            result["token_strs"] = await host.offload(size, _token_strs, tokenizer, tokens)
        return result

    async def detokenize(call: Call, body: bytes, host: Host) -> dict[str, Any]:
        size = len(body)
        request = await host.offload(size, parse_body, DetokenizeRequest, body)
        tokenizer = through(call, request.model, host)[0].tokenizer
        return await host.offload(size, _detokenized, tokenizer, request.tokens)

    def routes(host: Host) -> list[Route]:
        def handler(work: Callable[[Call, bytes, Host], Any], what: str) -> Any:
            async def handle(call: Call) -> int:
                try:
                    body = await host.read_body(call)
                    result = await work(call, body, host)
                    answer = await host.offload(len(body), orjson.dumps, result)
                except Refusal as exc:
                    error = exc.error
                except Exception as exc:  # InvalidRequest: a field, the template, the context
                    error = describe_failure(exc, what)
                else:
                    await send_json(call.send, 200, answer)
                    return 200
                rendered = OPENAI_ERRORS.render(error)
                await send_json(call.send, rendered.status, rendered.body, rendered.headers)
                return rendered.status

            return handle

        post = frozenset({"POST"})
        return [
            Route(TOKENIZE, post, handler(tokenize, "(tokenize)"), OPENAI_ERRORS, metered=True),
            Route(
                DETOKENIZE, post, handler(detokenize, "(detokenize)"), OPENAI_ERRORS, metered=True
            ),
        ]

    return routes
