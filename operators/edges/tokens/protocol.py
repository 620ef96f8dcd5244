"""vLLM's tokens-in/tokens-out request (``POST /inference/v1/generate``), as our graph takes it.

The body is vLLM 0.32's ``GenerateRequest``: the prompt's ``token_ids``, vLLM's own
``sampling_params``, ``stream`` (with ``stream_options.include_usage``), and a few fields
around them. It is parsed as every edge parses (:func:`operators.edges.http.schema.
parse_body`: a wrong type is a 400 naming the field, ``sampling_params.temperature``), and
becomes the :class:`~operators.contracts.llm.PreprocessedRequest` the preprocessor would
have made of a chat, without a template or a tokenizer: the model's context bounds the
prompt and ``max_tokens`` as for every API, its end-of-generation ids are hidden stops, and
its vocabulary bounds the ids (:meth:`OpenAIPreprocessor.fit`,
:meth:`~OpenAIPreprocessor.check_token_ids`).

What the graph cannot honour is refused by name, never ignored: multimodal ``features``
and ``content_parts``, KV and encoder transfer parameters, a ``cache_salt``,
``output_mode: "text"``, and the sampling fields we do not implement (``logit_bias``,
``prompt_logprobs``, ``allowed_token_ids``, ``bad_words``...). vLLM's fields that change
nothing here are accepted (``detokenize``: the answer is ids anyway).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Final, Literal

import orjson
from pydantic import Field, model_validator

from operators.contracts.llm import (
    Constraint,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from operators.edges.http.schema import (
    NOTHING,
    Bool,
    Count,
    Float,
    JsonObject,
    Model,
    Priority,
    Stop,
    TokenId,
    Unsupported,
    invalid,
    parse_body,
)
from operators.edges.openai import OpenAIPreprocessor, StreamOptions
from operators.edges.openai.protocol.requests import MAX_LOGPROBS, MAX_N
from pipeline import InvalidRequest

__all__ = (
    "GenerateRequest",
    "SamplingParams",
    "StructuredOutputs",
    "parse_generate",
    "preprocessed",
)

#: vLLM's sampling fields the graph does not honour: a 400 unless they ask for nothing
SAMPLING_UNSUPPORTED: Final[Mapping[str, Unsupported]] = {
    "prompt_logprobs": Unsupported("'prompt_logprobs' is not supported", NOTHING),
    "logit_bias": Unsupported("'logit_bias' is not supported", NOTHING),
    "allowed_token_ids": Unsupported("'allowed_token_ids' is not supported", NOTHING),
    "bad_words": Unsupported("'bad_words' is not supported", NOTHING),
    "logits_processors": Unsupported("'logits_processors' is not supported", NOTHING),
    "truncate_prompt_tokens": Unsupported("'truncate_prompt_tokens' is not supported", NOTHING),
    "extra_args": Unsupported("'extra_args' is not supported", NOTHING),
    "thinking_token_budget": Unsupported("'thinking_token_budget' is not supported", NOTHING),
}
#: the request's fields the graph does not honour
UNSUPPORTED: Final[Mapping[str, Unsupported]] = {
    "features": Unsupported("multimodal 'features' are not supported", NOTHING),
    "content_parts": Unsupported("multimodal 'content_parts' are not supported", NOTHING),
    "kv_transfer_params": Unsupported("'kv_transfer_params' is not supported", NOTHING),
    "ec_transfer_params": Unsupported("'ec_transfer_params' is not supported", NOTHING),
    "cache_salt": Unsupported("'cache_salt' is not supported", NOTHING),
    "token_offsets": Unsupported("'token_offsets' is not supported", NOTHING),
    "output_mode": Unsupported(
        "only output_mode 'tokens' is served here (the chat and completions APIs give text)",
        (None, "tokens"),
    ),
}
#: the longest request id a client may name its request with
MAX_REQUEST_ID: Final = 256


class StructuredOutputs(Model):
    """``sampling_params.structured_outputs``: a JSON value (by its schema, or any object)."""

    json_schema: JsonObject | str | None = Field(default=None, alias="json")
    json_object: Bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_json(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in ("regex", "choice", "grammar", "structural_tag"):
                if data.get(name) not in NOTHING:
                    raise invalid(
                        f"sampling_params.structured_outputs.{name}",
                        f"structured_outputs '{name}' is not supported (use 'json')",
                    )
        return data


class SamplingParams(Model):
    """vLLM's ``SamplingParams``, the fields the graph honours."""

    n: int = Field(default=1, strict=True, ge=1, le=MAX_N)
    max_tokens: Count | None = None
    min_tokens: int = Field(default=0, strict=True, ge=0)
    temperature: Float | None = Field(default=None, ge=0)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, strict=True, ge=-1)
    min_p: Float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**64)
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(default=None, gt=0, le=2)
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: Bool = False
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    #: the sampled token's logprob and this many alternatives
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, rule in SAMPLING_UNSUPPORTED.items():
                if name in data and rule.asks(data[name]):
                    raise invalid(f"sampling_params.{name}", rule.message)
            if None in data.values():  # (a null is the default, as at the top level)
                data = {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _fit(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise invalid(
                "sampling_params.min_tokens",
                f"'min_tokens' ({self.min_tokens}) exceeds 'max_tokens' ({self.max_tokens})",
            )
        return self


class GenerateRequest(Model):
    """The body of ``POST /inference/v1/generate``."""

    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    #: what the response calls the request (None: an id of its own)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID)
    #: lower runs earlier (None: the API key's default priority, else 0)
    priority: Priority | None = None
    #: the prompt's ids in the response (its first chunk, streaming)
    return_token_ids: Bool = False
    output_mode: Literal["tokens"] = "tokens"

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> GenerateRequest:
        if self.stream_options is not None and not self.stream:
            raise invalid(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        return self

    @property
    def include_usage(self) -> bool:
        """True when a stream ends with a usage chunk (a whole answer always has one)."""
        options = self.stream_options
        return not self.stream or (options is not None and options.include_usage)

    @property
    def name(self) -> str:
        """The request's id in the response."""
        return self.request_id or f"generate-tokens-{uuid.uuid4().hex}"


def parse_generate(body: bytes | str | Mapping[str, Any]) -> GenerateRequest:
    """Validate a ``/inference/v1/generate`` body.

    Raises:
        InvalidRequest: malformed JSON, an invalid or unsupported field (``param`` names
            it: ``sampling_params.logit_bias``).
    """
    return parse_body(GenerateRequest, body, unsupported=UNSUPPORTED)


def preprocessed(
    request: GenerateRequest,
    preprocessor: OpenAIPreprocessor,
    *,
    model: str,
    lora: str | None = None,
) -> PreprocessedRequest:
    """``request`` as the graph below the preprocessor takes it.

    Raises:
        InvalidRequest: an id outside the vocabulary, a prompt or ``max_tokens`` that does
            not fit the model's context, a schema that is not JSON.
    """
    ids = request.token_ids
    preprocessor.check_token_ids(ids, "token_ids")
    params = request.sampling_params
    max_tokens = preprocessor.fit(
        len(ids),
        params.max_tokens,
        what="prompt",
        param="token_ids",
        max_param="sampling_params.max_tokens",
    )
    stop = params.stop
    return PreprocessedRequest(
        token_ids=ids,
        stop=StopConditions(
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            stop=() if stop is None else (stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(params.stop_token_ids or ()),
            eos_token_ids=preprocessor.eos_token_ids,
            include_stop_str_in_output=params.include_stop_str_in_output,
            ignore_eos=params.ignore_eos,
        ),
        sampling=SamplingOptions(
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
        ),
        output=OutputOptions(
            logprobs=params.logprobs, skip_special_tokens=params.skip_special_tokens
        ),
        model=model,
        n=params.n,
        priority=request.priority or 0,
        lora=lora,
        constraint=_constraint(params.structured_outputs),
    )


def _constraint(structured: StructuredOutputs | None) -> Constraint | None:
    param = "sampling_params.structured_outputs"
    if structured is None:
        return None
    schema = structured.json_schema
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError:
            raise InvalidRequest(f"'{param}.json' is not a JSON schema", param=param) from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"'{param}.json' is not a JSON schema", param=param)
    if schema is not None:
        return Constraint(param=param, json_schema=schema)
    if structured.json_object:
        return Constraint(param=param)
    return None
