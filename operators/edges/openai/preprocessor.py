"""The OpenAI preprocessor: the first operator of every LLM graph.

Forward, it turns a validated :class:`~operators.edges.openai.protocol.ChatCompletionRequest` or
:class:`~operators.edges.openai.protocol.CompletionRequest` into a tokenized
:class:`~operators.contracts.llm.PreprocessedRequest` (chat template, tokenization, stop conditions,
sampling and output options, context-length checks). Backward, it turns the Backend's
:class:`~operators.contracts.llm.BackendOutput` stream into typed OpenAI events
(:mod:`operators.edges.openai.events`)::

    ChatCompletionRequest --[render template, encode]--> PreprocessedRequest --> Backend ...
    ResponseHead, ChoiceStart, ChoiceDelta.., Usage <--- BackendOutput      <-- Backend ...

The output is *always* stream-shaped: a :class:`~.events.ResponseHead` first, a
:class:`~.events.Usage` last. The HTTP server renders the events as server-sent events
(:mod:`operators.edges.openai.sse`, which writes the usage chunk only when the client asked for
it), or folds them into one response with :func:`aggregate_chat` /
:func:`aggregate_completion`, so streamed and non-streamed responses come from the same
code.

The event building itself (per-choice state, logprobs of delivered tokens, usage) lives in
:mod:`operators.edges.openai.chunks`; this module is the forward edge and the stream loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Container
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.to_thread

from operators.backend import CACHED_TOKENS
from operators.contracts.llm import BackendOutput, PreprocessedRequest
from pipeline import Context, Engine, InvalidRequest, State, Stream

from .chat_prompt import ChatPrompts
from .chunks import ChatChunks, CompletionChunks, TokenDecoder, TokenTexts
from .events import OpenAIEvent, aggregate_chat, aggregate_completion
from .images import ImagePolicy, ImageRef, load_images
from .prompt_size import OFF_LOOP_CHARS, prompt_sizes, refuse_unfittable
from .protocol import ChatCompletionRequest, CompletionRequest
from .structure import ConstraintBuilder, output_structure

if TYPE_CHECKING:
    from pipeline.tracing import Span

__all__ = (
    "OpenAIPreprocessor",
    "OpenAIRequest",
    "TokenizerLike",
    "aggregate_chat",
    "aggregate_completion",
)

logger = logging.getLogger(__name__)

OpenAIRequest = ChatCompletionRequest | CompletionRequest
"""What the preprocessor accepts: a validated chat or completions request."""


class TokenizerLike(TokenDecoder, Protocol):
    """What the preprocessor needs from a tokenizer (:class:`operators.text.tokenizer.Tokenizer`
    has it all). ``bos_token_id``, ``eos_token_id`` and ``vocab_size`` are used when present.
    """

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]: ...


class OpenAIPreprocessor:
    """Operator: OpenAI requests -> PreprocessedRequest; BackendOutput -> OpenAI chunks.

    Args:
        tokenizer: encodes prompts, renders token texts for logprobs.
        model_name: reported in responses when the request names no model.
        max_model_len: the context length; prompts (plus ``max_tokens``) must fit.
        default_max_tokens: the output limit when the request sets none (capped by what
            is left of ``max_model_len``).
        chat_template: Jinja source overriding the tokenizer's template.
        images: which image content parts are accepted (data: URLs by default; remote
            hosts only when allowed).
        tool_format: the tool-call format the server parses (None: requests with tools
            get a 400); it also builds the constraint of ``tool_choice: "required"``.
        adapters: the names of the model's adapters (LoRA), read at each request (a live
            set): a request naming one runs with it (``PreprocessedRequest.lora``).
        reasoning: the reasoning format the server parses (None: the model is not known to
            reason); its markers are what a reasoning budget forces (:mod:`.reasoning`).

    Raises:
        ValueError: the chat template does not compile.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        *,
        model_name: str,
        max_model_len: int | None = None,
        default_max_tokens: int | None = None,
        chat_template: str | None = None,
        images: ImagePolicy | None = None,
        tool_format: ConstraintBuilder | None = None,
        adapters: Container[str] = frozenset(),
        reasoning: object | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._adapters = adapters
        self._tool_format = tool_format
        self._images = ImagePolicy() if images is None else images
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._default_max_tokens = default_max_tokens
        self._eos_token_ids = tuple(sorted(tokenizer.eos_token_ids))
        self._vocab_size: int | None = getattr(tokenizer, "vocab_size", None)
        source = chat_template if chat_template is not None else tokenizer.chat_template
        self._chat = ChatPrompts.for_tokenizer(
            source,
            explicit=chat_template is not None,
            bos_token=_token_text(tokenizer, getattr(tokenizer, "bos_token_id", None)),
            eos_token=_token_text(tokenizer, _eos_token_id(tokenizer)),
            encode=self._encode_chat,
            reasoning=reasoning,
        )
        self._token_texts = TokenTexts(tokenizer)
        self._max_token_chars: int | None = getattr(tokenizer, "max_token_chars", None)
        #: one large prompt prepared at a time, in a worker thread (created on first use)
        self._large: anyio.CapacityLimiter | None = None

    # ------------------------------------------------------------------ forward edge

    @property
    def max_model_len(self) -> int | None:
        """The context length prompts (plus their output) must fit (None: unbounded)."""
        return self._max_model_len

    @property
    def tokenizer(self) -> TokenizerLike:
        """The tokenizer prompts are encoded with."""
        return self._tokenizer

    def render_chat(self, request: ChatCompletionRequest) -> str:
        """The prompt text of a chat request: its messages through the chat template.

        Image parts are left out of the text; :meth:`generate` loads them separately.

        Raises:
            InvalidRequest: no chat template, a reasoning setting it cannot honour, or the
                template rejected the conversation.
        """
        return self._chat.render(request, [])

    def _encode_chat(self, text: str) -> list[int]:
        # The rendered text is encoded with special tokens parsed, because the template's
        # role markers must become control ids. The users' message text is part of that
        # text, so "<|im_start|>" typed in a message also becomes a control id: keeping
        # user text plain would mean encoding the template's pieces separately. vLLM and
        # llama.cpp's server behave the same way.
        return self._tokenizer.encode(text, add_special_tokens=False, parse_special=True)

    def preprocess(self, request: OpenAIRequest) -> list[PreprocessedRequest]:
        """The tokenized request: one per prompt (several for a completions batch).

        Raises:
            InvalidRequest: an empty prompt, a prompt or ``max_tokens`` that does not fit
                the context, token ids outside the vocabulary, or what :meth:`render_chat`
                raises.
        """
        self._refuse_unfittable(request)
        return [leg.request for leg in self._legs(request)]

    async def prepare(
        self, request: OpenAIRequest, *, add_generation_prompt: bool = True
    ) -> list[PreprocessedRequest]:
        """:meth:`preprocess`, in a worker thread when the prompts are large: exactly the
        token ids a request of the graph gets (``count_tokens`` and ``/tokenize`` count
        them); ``add_generation_prompt=False`` renders a chat without the assistant's
        opening.

        Raises:
            InvalidRequest: as :meth:`preprocess`.
        """
        legs = await self._prepare(request, add_generation_prompt=add_generation_prompt)
        return [leg.request for leg in legs]

    def _legs(
        self,
        request: OpenAIRequest,
        span: Span | None = None,
        add_generation_prompt: bool = True,
    ) -> list[_Leg]:
        """The legs of ``request``, which :meth:`_refuse_unfittable` has let through;
        ``span`` (a traced request's) gets an event when the template is rendered and
        when each prompt is tokenized."""
        if isinstance(request, ChatCompletionRequest):
            return [self._chat_leg(request, span, add_generation_prompt)]
        legs = []
        echo = request.echo
        batch = len(request.prompts) > 1
        for position, prompt in enumerate(request.prompts):
            param = f"prompt.{position}" if batch else "prompt"
            if isinstance(prompt, str):
                # A completions prompt is raw model input that the client owns whole, so
                # control-token texts in it are parsed (vLLM and llama.cpp's server do the
                # same): that is how clients write their own chat formats. There is no
                # template here whose structure user text could escape from.
                ids = self._tokenizer.encode(prompt, add_special_tokens=True, parse_special=True)
                shown = prompt
            else:
                ids = list(prompt)
                self.check_token_ids(ids, param)
                shown = self._tokenizer.decode(ids) if echo else ""
            if span is not None:
                span.add_event("tokenized", {"llm_pipeline.prompt_tokens": len(ids)})
            legs.append(self._leg(request, ids, param, shown if echo else ""))
        return legs

    def _chat_leg(
        self, request: ChatCompletionRequest, span: Span | None, add_generation_prompt: bool
    ) -> _Leg:
        chat = self._chat.prompt(
            request, max_model_len=self._max_model_len, add_generation_prompt=add_generation_prompt
        )
        if span is not None:
            span.add_event("template_rendered", {"llm_pipeline.prompt_chars": chat.chars})
            span.add_event("tokenized", {"llm_pipeline.prompt_tokens": len(chat.token_ids)})
        tools, constraint = output_structure(request, self._tool_format)
        leg = self._leg(request, chat.token_ids, "messages", "")
        leg.images = chat.images
        leg.request.tools = tools
        leg.request.constraint = constraint
        markers = self._chat.markers
        if markers is not None:
            budget = chat.reasoning.budget(markers, leg.request.stop.max_tokens)
            if budget is not None and constraint is not None:
                raise InvalidRequest(
                    f"'{budget.param}' cannot be combined with '{constraint.param}': the "
                    "constraint holds for the whole output, the reasoning included",
                    param=budget.param,
                )
            leg.request.reasoning_budget = budget
        return leg

    def _leg(self, request: OpenAIRequest, ids: list[int], param: str, echo: str) -> _Leg:
        what = "messages" if param == "messages" else "prompt"
        requested, max_param = request.requested_max_tokens
        max_tokens = self.fit(len(ids), requested, what=what, param=param, max_param=max_param)
        preprocessed = PreprocessedRequest(
            token_ids=ids,
            stop=request.stop_conditions(max_tokens=max_tokens, eos_token_ids=self._eos_token_ids),
            sampling=request.sampling_options(),
            output=request.output_options(),
            model=request.model or self._model_name,
            n=request.n,
            priority=request.priority or 0,
            lora=request.model if request.model in self._adapters else None,
            affinity=request.prompt_cache_key,
        )
        return _Leg(preprocessed, echo)

    def _refuse_unfittable(self, request: OpenAIRequest) -> int:
        """Refuse a prompt that cannot fit the context whatever its token count (without
        encoding it: :mod:`.prompt_size`), unless it may be truncated to fit; the prompts'
        total size otherwise."""
        sizes = prompt_sizes(request)
        if isinstance(request, ChatCompletionRequest) and request.truncation_keep is not None:
            return sum(size.size for size in sizes)
        refuse_unfittable(
            request,
            sizes,
            max_model_len=self._max_model_len,
            max_token_chars=self._max_token_chars,
        )
        return sum(size.size for size in sizes)

    async def _prepare(
        self,
        request: OpenAIRequest,
        span: Span | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[_Leg]:
        """:meth:`_legs`, in a worker thread when the prompts are large.

        Rendering and encoding a large prompt take long enough to stall every other request
        if done on the event loop; one large request at a time is prepared in a thread (the
        tokenizer encodes long texts in short pieces, and stops between them once the request
        is cancelled). Those that cannot fit the context are refused first, on the loop.
        """
        if self._refuse_unfittable(request) <= OFF_LOOP_CHARS:
            return self._legs(request, span, add_generation_prompt)
        if self._large is None:
            self._large = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(
            self._legs, request, span, add_generation_prompt, limiter=self._large
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-generation ids (the Backend's hidden stops)."""
        return self._eos_token_ids

    def fit(
        self, prompt_len: int, max_tokens: int | None, *, what: str, param: str, max_param: str
    ) -> int | None:
        """The output limit of a prompt of ``prompt_len`` tokens asking for ``max_tokens``
        (None: the default, capped by the room the context leaves).

        Raises:
            InvalidRequest: an empty prompt or one that leaves no room (naming ``param``,
                calling it ``what``), or ``max_tokens`` over the room (naming ``max_param``).
        """
        if prompt_len == 0:
            raise InvalidRequest(f"the {what} is empty (no tokens)", param=param)
        limit = self._max_model_len
        if limit is not None:
            if prompt_len >= limit:
                raise InvalidRequest(
                    f"This model's maximum context length is {limit} tokens, but the {what} "
                    f"has {prompt_len} tokens, which leaves no room for a completion. "
                    f"Shorten the {what}.",
                    param=param,
                )
            if max_tokens is not None and prompt_len + max_tokens > limit:
                raise InvalidRequest(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
                    f"{max_tokens} for the completion). Reduce the length of the {what} or "
                    f"'{max_param}'.",
                    param=max_param,
                )
        if max_tokens is None:
            max_tokens = self._default_max_tokens
            if limit is not None:
                room = limit - prompt_len
                max_tokens = room if max_tokens is None else min(max_tokens, room)
        return max_tokens

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Refuse an id outside the vocabulary, naming ``param.<position>``.

        Raises:
            InvalidRequest: the first such id.
        """
        vocab_size = self._vocab_size
        if vocab_size is not None:
            for position, token_id in enumerate(ids):
                if token_id >= vocab_size:
                    raise InvalidRequest(
                        f"token id {token_id} is outside the vocabulary (size {vocab_size})",
                        param=f"{param}.{position}",
                    )

    # ---------------------------------------------------------------------- the stream

    async def generate(
        self,
        ctx: Context[OpenAIRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[OpenAIEvent]:
        """Serve one OpenAI request with ``downstream``, yielding its response events.

        A completions batch (several prompts) runs its prompts one after another, each as
        a child leg with its own state scope, so the Backends' decoders never collide.

        Raises:
            InvalidRequest: see :meth:`preprocess`; downstream errors pass unchanged.
        """
        request = ctx.data
        span = ctx.span
        legs = await self._prepare(request, span)
        model = request.model or self._model_name
        prompt_tokens = sum(leg.request.prompt_tokens for leg in legs)
        kind = ChatChunks if isinstance(request, ChatCompletionRequest) else CompletionChunks
        chunks = kind(
            model=model,
            logprobs=request.logprobs_count,
            texts=self._token_texts,
            request_id=ctx.id,
            prompt_tokens=prompt_tokens,
        )
        n = request.n
        for leg in legs:
            if leg.images:
                multimodal = await load_images(leg.images, self._images)
                leg.request = dataclasses.replace(leg.request, multimodal=multimodal)
                if span is not None:
                    span.add_event("images_loaded", {"llm_pipeline.images": len(multimodal)})
        yield chunks.head
        cached: int | None = None
        for position, leg in enumerate(legs):
            chunks.start_prompt(position * n, leg.echo)
            leg_ctx = (
                ctx.replace(leg.request)
                if len(legs) == 1
                else ctx.child(leg.request, state=State())
            )
            async with aclosing(downstream.generate(leg_ctx)) as stream:
                async for output in stream:
                    for event in chunks.feed(output):
                        yield event
            hits = leg_ctx.state.get(CACHED_TOKENS, None)
            if hits is not None:  # (a retry's prompt includes replayed output: clamp)
                cached = (cached or 0) + min(hits, leg.request.prompt_tokens)
        yield chunks.usage(prompt_tokens, cached)


@dataclass(slots=True)
class _Leg:
    request: PreprocessedRequest
    #: completions ``echo``: the prompt text the first chunk of each choice starts with
    echo: str
    #: image content parts, loaded (decoded or fetched) just before the request goes on
    images: list[ImageRef] = field(default_factory=list)


# ---------------------------------------------------------------------------- helpers


def _eos_token_id(tokenizer: TokenizerLike) -> int | None:
    declared: int | None = getattr(tokenizer, "eos_token_id", None)
    if declared is not None:
        return declared
    return min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None


def _token_text(tokenizer: TokenizerLike, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    return tokenizer.decode([token_id], skip_special_tokens=False)
