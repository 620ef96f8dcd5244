"""The OpenAI request models: the HTTP edge where untrusted JSON becomes typed requests.

This is the only module in ``operators/`` that imports pydantic. It validates the bodies of
``/v1/chat/completions`` (:class:`ChatCompletionRequest`) and ``/v1/completions``
(:class:`CompletionRequest`) and converts the generation fields into the hot-path records of
:mod:`operators.llm` (:meth:`GenerationRequest.stop_conditions`, ``sampling_options()``,
``output_options()``). Responses are *not* modelled here: the preprocessor builds stream
chunks as plain dicts, because a pydantic object per token is the cost this project avoids.

:func:`parse_chat_request` and :func:`parse_completion_request` are the one boundary where
JSON and pydantic errors become :class:`pipeline.InvalidRequest`, with ``param`` naming the
offending field as a dotted path (``"messages.0.content"``). OpenAI fields the server cannot
honour (``tools``, ``response_format``, ``logit_bias``...) are refused with a 400 naming them
(:mod:`.unsupported`); fields we do not know (``extra_body`` extensions of other servers)
are ignored; ``null`` means "use the default" for every top-level field.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from operators.llm import OutputOptions, SamplingOptions, StopConditions
from pipeline import InvalidRequest

from .unsupported import refuse_unsupported

__all__ = (
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "GenerationRequest",
    "ImageURL",
    "StreamOptions",
    "parse_chat_request",
    "parse_completion_request",
)

#: most choices one request may ask for
MAX_N: Final = 128
#: most stop strings one request may give
MAX_STOP_STRINGS: Final = 64
#: most alternatives per position (chat ``top_logprobs``, completions ``logprobs``)
MAX_LOGPROBS: Final = 20

# Integers and booleans are strict: JSON ``true`` is not a count, ``"yes"`` not a boolean.
_Count = Annotated[int, Field(strict=True, ge=1)]
_TokenId = Annotated[int, Field(strict=True, ge=0)]
_Float = Annotated[float, Field(allow_inf_nan=False)]
_Bool = Annotated[bool, Field(strict=True)]


def _kind_of_content(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "parts"
    return None


def _kind_of_prompt(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else None
        if isinstance(first, str):
            return "texts"
        if isinstance(first, list):
            return "id_lists"
        return "ids"  # ints, or anything else: then the int errors name the bad position
    return None


def _kind_of_stop(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "texts"
    return None


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False, validate_assignment=False)


class ImageURL(_Model):
    """The ``image_url`` object of an image content part."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Model):
    """One part of a message's content array: text, or an image (parsed, not yet served)."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _has_its_payload(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise PydanticCustomError("missing_text", "a 'text' content part needs a 'text' string")
        if self.type == "image_url" and self.image_url is None:
            raise PydanticCustomError(
                "missing_image_url", "an 'image_url' content part needs an 'image_url' object"
            )
        return self


_Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(
        _kind_of_content,
        custom_error_type="invalid_content",
        custom_error_message="content must be a string or an array of content parts",
    ),
]


class ChatMessage(_Model):
    """One message of a chat. ``content`` may be null only for an assistant message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _Content | None = None
    name: str | None = None
    #: an assistant's earlier tool calls, passed to the chat template as they came
    tool_calls: list[dict[str, Any]] | None = None
    #: the call a ``tool`` message answers
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError(
                "missing_content", "a {role} message needs 'content'", {"role": self.role}
            )
        return self


class StreamOptions(_Model):
    """``stream_options``: only allowed with ``stream: true``."""

    include_usage: _Bool = False


_Stop = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[str], Tag("texts")],
    Discriminator(
        _kind_of_stop,
        custom_error_type="invalid_stop",
        custom_error_message="stop must be a string or an array of strings",
    ),
]


class GenerationRequest(_Model):
    """The fields chat and completions requests share, and their hot-path conversions."""

    #: the model the client asked for (echoed back in responses); optional here
    model: str | None = None
    n: int = Field(default=1, strict=True, ge=1, le=MAX_N)
    stream: _Bool = False
    stream_options: StreamOptions | None = None
    max_tokens: _Count | None = None
    stop: _Stop | None = None
    temperature: _Float | None = Field(default=None, ge=0, le=2)
    top_p: _Float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**64)
    presence_penalty: _Float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: _Float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # Extensions (vLLM's names), sent by OpenAI clients through ``extra_body``.
    min_tokens: int = Field(default=0, strict=True, ge=0)
    ignore_eos: _Bool = False
    include_stop_str_in_output: _Bool = False
    skip_special_tokens: _Bool = True
    stop_token_ids: list[_TokenId] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            return None
        if len(stop) > MAX_STOP_STRINGS:
            raise PydanticCustomError(
                "too_long", "at most {limit} stop strings are allowed", {"limit": MAX_STOP_STRINGS}
            )
        if "" in stop:
            raise PydanticCustomError("empty_stop", "stop strings must not be empty")
        return stop

    @model_validator(mode="after")
    def _check_combinations(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise _invalid(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        max_tokens, param = self.requested_max_tokens
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise _invalid(
                "min_tokens", f"'min_tokens' ({self.min_tokens}) exceeds '{param}' ({max_tokens})"
            )
        return self

    # ---------------------------------------------------------------- derived values

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The client's output-length limit and the name of the field that set it."""
        return self.max_tokens, "max_tokens"

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def logprobs_count(self) -> int | None:
        """None: no logprobs; k: the sampled token's logprob and k alternatives."""
        return None

    def stop_conditions(
        self, *, max_tokens: int | None, eos_token_ids: tuple[int, ...]
    ) -> StopConditions:
        """The request's stop rules; ``max_tokens`` already resolved against the model."""
        stop = self.stop
        if isinstance(stop, str):  # only when built without validation
            stop = [stop]
        return StopConditions(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=() if stop is None else tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            eos_token_ids=eos_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
        )

    def sampling_options(self) -> SamplingOptions:
        """Sampling parameters for the engine."""
        return SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

    def output_options(self) -> OutputOptions:
        """What the client wants besides text."""
        return OutputOptions(
            logprobs=self.logprobs_count, skip_special_tokens=self.skip_special_tokens
        )


class ChatCompletionRequest(GenerationRequest):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    #: the newer name of ``max_tokens``; wins when both are given
    max_completion_tokens: _Count | None = None
    logprobs: _Bool = False
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        return self

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts"), Field(min_length=1)]
    | Annotated[list[_TokenId], Tag("ids"), Field(min_length=1)]
    | Annotated[
        list[Annotated[list[_TokenId], Field(min_length=1)]], Tag("id_lists"), Field(min_length=1)
    ],
    Discriminator(
        _kind_of_prompt,
        custom_error_type="invalid_prompt",
        custom_error_message=(
            "prompt must be a string, an array of strings, an array of token ids "
            "or an array of arrays of token ids"
        ),
    ),
]


class CompletionRequest(GenerationRequest):
    """The body of ``POST /v1/completions``.

    A prompt that is a list of strings or a list of token-id lists is a batch: each prompt
    gets ``n`` choices, numbered ``prompt_index * n + i``.
    """

    prompt: _Prompt
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    echo: _Bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise _invalid(
                "echo", "'echo' together with 'logprobs' is not supported (no prompt logprobs)"
            )
        if self.suffix:
            raise _invalid("suffix", "'suffix' (insertion) is not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not isinstance(prompt[0], str | list):
            return [prompt]
        return list(prompt)

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


# ------------------------------------------------------------------------ the boundary

_M = TypeVar("_M", bound=GenerationRequest)


def parse_chat_request(body: bytes | str | dict[str, Any]) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    return _parse(ChatCompletionRequest, body)


def parse_completion_request(body: bytes | str | dict[str, Any]) -> CompletionRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        InvalidRequest: malformed JSON or an invalid field (``param`` names it).
    """
    return _parse(CompletionRequest, body)


def _parse(model: type[_M], body: bytes | str | dict[str, Any]) -> _M:
    data: Any = body
    if not isinstance(body, dict):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if isinstance(body, bytes) and not _is_utf8(body):
                raise InvalidRequest("the request body is not valid UTF-8") from exc
            raise InvalidRequest(f"could not parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {type(data).__name__}")
    refuse_unsupported(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from exc


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _invalid(param: str, message: str) -> PydanticCustomError:
    """An error for a rule across fields, carrying the field to blame."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for model in models:
        names.update(model.model_fields)
    return frozenset(names)


# Path segments that are field names (or list indexes) stay in ``param``; the others are
# union tags pydantic puts into ``loc`` ("text", "parts", "ids", ...) and are dropped. No tag
# is also a field name of a model it appears under.
_FIELDS: Final = _field_names(
    ChatCompletionRequest, CompletionRequest, ChatMessage, ContentPart, ImageURL, StreamOptions
)


def _param(error: ErrorDetails) -> str | None:
    ctx = error.get("ctx") or {}
    if "param" in ctx:
        return str(ctx["param"])
    parts = [str(seg) for seg in error["loc"] if isinstance(seg, int) or seg in _FIELDS]
    return ".".join(parts) or None


def _from_validation_error(exc: ValidationError) -> InvalidRequest:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    param = _param(first)
    ctx = first.get("ctx") or {}
    if "param" in ctx:  # a rule across fields: its message names the fields itself
        message = str(ctx["message"])
    elif first["type"] == "missing":
        message = f"Missing required parameter: '{param}'"
    elif param is None:
        message = f"Invalid request: {first['msg']}"
    else:
        message = f"Invalid value for '{param}': {first['msg']}"
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return InvalidRequest(message, param=param)
