"""``POST /v1/embeddings``: OpenAI's embeddings, from the engine's optional ``embed``.

``input`` is a string, a list of strings, a list of token ids or a list of such lists;
strings are encoded with the model's tokenizer (its preprocessor's). ``encoding_format``
``float`` gives lists of numbers, ``base64`` the little-endian float32 bytes (what OpenAI's
SDKs ask for by default). ``usage.prompt_tokens`` counts every input's tokens. The model's
vectors have one length: ``dimensions`` is refused (a 400 naming it) since no engine here
can shorten them. An engine without ``embed`` (echo, mocker, a router over in-process
workers) answers a 400 naming ``model``. Embeddings do not run through the graph: no
migration, no stop strings; the request timeout applies.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import anyio
import anyio.to_thread
import orjson
from pydantic import Discriminator, Field, Tag, ValidationError

from operators.edges.http.asgi import BodyTooLarge, read_body, send_json
from operators.edges.http.failures import (
    ApiError,
    Refusal,
    body_too_large,
    describe_failure,
    timed_out,
)
from operators.edges.http.routes import Call, Host, Route, resolve_model
from pipeline import InvalidRequest

from .errors import OPENAI_ERRORS
from .prompt_size import OFF_LOOP_CHARS
from .protocol.base import Model, TokenId
from .protocol.parsing import from_validation_error

if TYPE_CHECKING:
    from operators.contracts.llm import Embedder

    from .preprocessor import TokenizerLike

__all__ = (
    "EMBEDDINGS",
    "MAX_INPUTS",
    "EmbeddingRequest",
    "embedding_routes",
    "parse_embedding_request",
)

EMBEDDINGS: Final = "/v1/embeddings"
#: most inputs one request may hold (OpenAI's limit)
MAX_INPUTS: Final = 2048


def _kind_of_input(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else None
        if isinstance(first, str):
            return "texts"
        if isinstance(first, list):
            return "id_lists"
        return "ids"
    return None


_Input = Annotated[
    Annotated[str, Tag("text"), Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Tag("texts"), Field(min_length=1)]
    | Annotated[list[TokenId], Tag("ids"), Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Tag("id_lists"), Field(min_length=1)
    ],
    Discriminator(
        _kind_of_input,
        custom_error_type="invalid_input",
        custom_error_message=(
            "input must be a string, an array of strings, an array of token ids or an array "
            "of arrays of token ids"
        ),
    ),
]


class EmbeddingRequest(Model):
    """The body of ``POST /v1/embeddings``."""

    model: str | None = None
    input: _Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        """The input as a batch: each item a string or a list of token ids."""
        given = self.input
        if isinstance(given, str) or not isinstance(given[0], str | list):
            return [given]
        return list(given)


_FIELDS: Final = frozenset(EmbeddingRequest.model_fields)


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"could not parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {type(data).__name__}")
    if data.get("dimensions") is not None:
        raise InvalidRequest(
            "this model's embeddings have one size: 'dimensions' is not supported",
            param="dimensions",
        )
    try:
        request = EmbeddingRequest.model_validate(
            {key: value for key, value in data.items() if value is not None}
        )
    except ValidationError as exc:
        raise from_validation_error(exc, _FIELDS) from exc
    if len(request.inputs) > MAX_INPUTS:
        raise InvalidRequest(f"at most {MAX_INPUTS} inputs are allowed", param="input")
    return request


def _encoded(vector: Sequence[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(vector)
    packed = array("f", vector)  # float32, the machine's order: little-endian on ours
    return base64.b64encode(packed.tobytes()).decode()


def embedding_routes(
    embedder: Embedder | None = None, tokenizer: TokenizerLike | None = None
) -> Callable[[Host], list[Route]]:
    """The embeddings route: each request's model embeds through its own embedder and
    tokenizer (:class:`~operators.edges.http.models.ServedModel`), or through ``embedder``
    and ``tokenizer`` when it has none; a model with no embedder is a 400 naming
    ``model``."""

    def routes(host: Host) -> list[Route]:
        async def embeddings(call: Call) -> int:
            try:
                result = await _embed(call, host)
            except Refusal as exc:
                error = exc.error
            except TimeoutError:
                limit = host.guard.request_timeout or 0.0
                error = timed_out(limit)
            except Exception as exc:  # InvalidRequest, EngineError, a lost worker
                error = describe_failure(exc, "(embeddings)")
            else:
                await send_json(call.send, 200, orjson.dumps(result))
                return 200
            rendered = OPENAI_ERRORS.render(error)
            await send_json(call.send, rendered.status, rendered.body, rendered.headers)
            return rendered.status

        async def _embed(call: Call, host: Host) -> dict[str, Any]:
            limit = host.generations.max_body_bytes
            try:
                body = await read_body(call.receive, limit)
            except BodyTooLarge:
                raise Refusal(body_too_large(limit)) from None
            if body is None:
                raise Refusal(ApiError("invalid_request", "the client went away"))
            request = parse_embedding_request(body)
            model = resolve_model(call, request.model, host)
            own = model.preprocessor
            served = model.embedder if model.embedder is not None else embedder
            encoder = own.tokenizer if own is not None else tokenizer
            if served is None or encoder is None:
                raise InvalidRequest(
                    f"the model {model.name!r} does not serve embeddings (its engine has no embed)",
                    param="model",
                )
            inputs = request.inputs
            if sum(len(item) for item in inputs) > OFF_LOOP_CHARS:
                ids = await anyio.to_thread.run_sync(_encode, inputs, encoder)
            else:
                ids = _encode(inputs, encoder)
            timeout = host.guard.request_timeout
            with anyio.fail_after(timeout):
                vectors = await served.embed(ids)
            tokens = sum(len(item) for item in ids)
            return {
                "object": "list",
                "data": [
                    {
                        "object": "embedding",
                        "index": index,
                        "embedding": _encoded(vector, request.encoding_format),
                    }
                    for index, vector in enumerate(vectors)
                ],
                "model": request.model or model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }

        return [Route(EMBEDDINGS, frozenset({"POST"}), embeddings, OPENAI_ERRORS)]

    return routes


def _encode(inputs: list[str | list[int]], tokenizer: TokenizerLike) -> list[list[int]]:
    vocab: int | None = getattr(tokenizer, "vocab_size", None)
    encoded: list[list[int]] = []
    for position, item in enumerate(inputs):
        if isinstance(item, str):
            encoded.append(tokenizer.encode(item, add_special_tokens=True, parse_special=True))
            continue
        if vocab is not None and any(token >= vocab for token in item):
            raise InvalidRequest(
                f"a token id is outside the vocabulary (size {vocab})",
                param=f"input.{position}" if len(inputs) > 1 else "input",
            )
        encoded.append(list(item))
    return encoded
