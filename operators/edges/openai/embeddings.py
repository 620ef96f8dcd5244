"""``POST /v1/embeddings``: OpenAI's embeddings, from the engine's optional ``embed``.

``input`` is a string, a list of strings, a list of token ids or a list of such lists;
strings are encoded with the model's tokenizer (its preprocessor's). ``encoding_format``
``float`` gives lists of numbers, ``base64`` the little-endian float32 bytes (what OpenAI's
SDKs ask for by default). ``usage.prompt_tokens`` counts every input's tokens. The model's
vectors have one length: ``dimensions`` is refused (a 400 naming it) since no engine here
can shorten them. An engine without ``embed`` (echo, mocker, a router over in-process
workers) answers a 400 naming ``model``. The route is metered: a request counts against
its key's requests per minute, and its input tokens against its tokens per minute (a 429
before the engine runs). Embeddings do not run through the graph: no
migration, no stop strings; the request timeout applies.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import anyio
import orjson
from pydantic import Field, model_validator

from operators.edges.http.asgi import send_json
from operators.edges.http.failures import Refusal, describe_failure, timed_out
from operators.edges.http.routes import Call, Host, Route, resolve_model
from operators.edges.http.schema import (
    ARRAY,
    ARRAYS,
    STRING,
    STRINGS,
    Model,
    TokenId,
    Unsupported,
    by_shape,
    invalid,
    kind,
    parse_body,
)
from pipeline import InvalidRequest

from .errors import OPENAI_ERRORS

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


_Input = Annotated[
    Annotated[str, kind(STRING), Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], kind(STRINGS), Field(min_length=1)]
    | Annotated[list[TokenId], kind(ARRAY), Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], kind(ARRAYS), Field(min_length=1)
    ],
    by_shape(
        "input must be a string, an array of strings, an array of token ids or an array "
        "of arrays of token ids",
        STRING,
        STRINGS,
        ARRAY,
        ARRAYS,
        error="invalid_input",
    ),
]

#: what no engine here can do: shorten the model's vectors
UNSUPPORTED: Final[Mapping[str, Unsupported]] = {
    "dimensions": Unsupported(
        "this model's embeddings have one size: 'dimensions' is not supported"
    ),
}


class EmbeddingRequest(Model):
    """The body of ``POST /v1/embeddings``."""

    model: str | None = None
    input: _Input
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @model_validator(mode="after")
    def _not_too_many(self) -> EmbeddingRequest:
        given = self.input
        if isinstance(given, list) and given and isinstance(given[0], str | list):
            if len(given) > MAX_INPUTS:
                raise invalid("input", f"at most {MAX_INPUTS} inputs are allowed")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """The input as a batch: each item a string or a list of token ids."""
        given = self.input
        if isinstance(given, str) or not isinstance(given[0], str | list):
            return [given]
        return list(given)


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    return parse_body(EmbeddingRequest, body, unsupported=UNSUPPORTED)


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
            body = await host.read_body(call)
            request = await host.offload(len(body), parse_embedding_request, body)
            model = resolve_model(call, request.model, host)
            own = model.preprocessor
            served = model.embedder if model.embedder is not None else embedder
            encoder = own.tokenizer if own is not None else tokenizer
            if served is None or encoder is None:
                raise InvalidRequest(
                    f"the model {model.name!r} does not serve embeddings (its engine has no embed)",
                    param="model",
                )
            ids = await host.offload(len(body), _encode, request.inputs, encoder)
            tokens = sum(len(item) for item in ids)
            if call.ticket is not None:  # (its key's tokens per minute: 429 if over)
                await call.ticket.charge(tokens)
            timeout = host.guard.request_timeout
            with anyio.fail_after(timeout):
                vectors = await served.embed(ids)
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

        return [Route(EMBEDDINGS, frozenset({"POST"}), embeddings, OPENAI_ERRORS, metered=True)]

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
