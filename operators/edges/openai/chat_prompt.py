"""A chat request's prompt: its messages through the chat template, encoded.

The chat half of the preprocessor's forward edge (:class:`ChatPrompts`)::

    messages --[the template: the model's, or the tool template when tools are involved]
             --[variables: reasoning_effort, enable_thinking (.reasoning)]
             --[truncation: oldest messages dropped until it fits, when the request allows]
             --> text --[tokenizer, special tokens parsed]--> token ids (+ image parts)

**Truncation** (the Responses API's ``truncation: "auto"``): a conversation too long for
the context keeps its first messages (the instructions) and drops the ones after them,
oldest first, until the prompt fits: fewer tokens than the context, and room for
``max_tokens`` when the request sets it. Tool results whose call was dropped go with it (a
template shown a result of no call may refuse the conversation). The last message always
stays: if it alone does not fit, the request gets the usual 400. How many to drop is found
by bisection (each probe renders and encodes what is left: O(n log n) for n messages); a
conversation that fits costs one render, as without truncation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline import InvalidRequest

from .chat_template import ChatTemplate, tool_chat_template
from .images import ImageRef
from .reasoning import ReasoningMarkers, ReasoningPlan, reasoning_plan
from .structure import involves_tools

if TYPE_CHECKING:
    from .protocol import ChatCompletionRequest, ChatMessage, ContentPart

__all__ = ("ChatPrompt", "ChatPrompts", "template_messages")

Encode = Callable[[str], list[int]]
"""Text -> token ids, special tokens parsed (the template's role markers are control ids)."""


@dataclass(slots=True)
class ChatPrompt:
    """A chat request's prompt, rendered and encoded."""

    token_ids: list[int]
    #: the rendered text's length (for a traced request's span)
    chars: int
    #: image content parts of the messages kept, in order (loaded just before the engine)
    images: list[ImageRef] = field(default_factory=list)
    #: what the request's reasoning settings ask (a budget is made once the output limit is
    #: known)
    reasoning: ReasoningPlan = field(default_factory=ReasoningPlan)


class ChatPrompts:
    """Renders and encodes chat requests for one model.

    ``template``: the model's (None: chat requests are refused); ``tool_template``: what
    requests involving tools render through (the model's own when it shows tools);
    ``reasoning``: the server's reasoning format (None: the model is not known to reason),
    whose markers a reasoning budget forces.
    """

    def __init__(
        self,
        template: ChatTemplate | None,
        tool_template: ChatTemplate | None,
        encode: Encode,
        *,
        reasoning: object | None = None,
    ) -> None:
        self._template = template
        self._tool_template = tool_template
        self._encode = encode
        self._reasons = reasoning is not None
        #: the format's markers as token ids (None: none to force)
        self.markers = None if reasoning is None else ReasoningMarkers.of(reasoning, encode)

    @classmethod
    def for_tokenizer(
        cls,
        source: str | None,
        *,
        explicit: bool,
        bos_token: str | None,
        eos_token: str | None,
        encode: Encode,
        reasoning: object | None = None,
    ) -> ChatPrompts:
        """The prompts of a model whose template is ``source`` (``explicit``: the user's,
        respected as is even for tools; else the shipped tool template stands in when it
        ignores tools).

        Raises:
            ValueError: a template does not compile.
        """
        template = None
        if source is not None:
            template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
        tool_template = template
        if not explicit and (template is None or not template.handles_tools):
            tool_template = ChatTemplate(
                tool_chat_template(), bos_token=bos_token, eos_token=eos_token
            )
        return cls(template, tool_template, encode, reasoning=reasoning)

    def template_for(self, request: ChatCompletionRequest) -> ChatTemplate:
        """The template ``request`` renders through.

        Raises:
            InvalidRequest: the model has no chat template.
        """
        template = self._tool_template if involves_tools(request) else self._template
        if template is None:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions with a prompt",
                param="messages",
            )
        return template

    def render(
        self,
        request: ChatCompletionRequest,
        images: list[ImageRef],
        *,
        add_generation_prompt: bool = True,
        messages: Sequence[ChatMessage] | None = None,
        plan: ReasoningPlan | None = None,
        template: ChatTemplate | None = None,
    ) -> str:
        """The prompt text of ``request`` (or of ``messages`` in its place) through
        ``template`` (None: :meth:`template_for`); image parts are appended to ``images``
        instead of the text.

        Raises:
            InvalidRequest: no chat template, a reasoning setting it cannot honour, or the
                template rejected the conversation.
        """
        if template is None:
            template = self.template_for(request)
        if plan is None:
            plan = self.plan(request, template)
        tools = None
        if request.effective_tool_choice != "none":
            tools = [tool.as_template_dict() for tool in request.tools or ()]
        return template.render(
            template_messages(request.messages if messages is None else messages, images),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **plan.variables,
        )

    def plan(self, request: ChatCompletionRequest, template: ChatTemplate) -> ReasoningPlan:
        """What ``request``'s reasoning settings ask of ``template`` and the engine.

        Raises:
            InvalidRequest: a setting that cannot be honoured (:func:`.reasoning_plan`).
        """
        return reasoning_plan(request, template, reasons=self._reasons, markers=self.markers)

    def prompt(
        self,
        request: ChatCompletionRequest,
        *,
        max_model_len: int | None,
        add_generation_prompt: bool = True,
    ) -> ChatPrompt:
        """``request``'s prompt, truncated to fit ``max_model_len`` when it allows.

        Raises:
            InvalidRequest: as :meth:`render`.
        """
        template = self.template_for(request)
        plan = self.plan(request, template)
        keep = request.truncation_keep
        messages: Sequence[ChatMessage] = request.messages
        images: list[ImageRef] = []
        text = self.render(
            request,
            images,
            add_generation_prompt=add_generation_prompt,
            plan=plan,
            template=template,
        )
        ids = self._encode(text)
        if keep is None or max_model_len is None or _fits(request, len(ids), max_model_len):
            return ChatPrompt(ids, len(text), images, plan)

        def encoded(dropped: int) -> tuple[list[int], str, list[ImageRef]]:
            kept = _without(messages, keep, dropped)
            found: list[ImageRef] = []
            rendered = self.render(
                request,
                found,
                add_generation_prompt=add_generation_prompt,
                messages=kept,
                plan=plan,
                template=template,
            )
            return self._encode(rendered), rendered, found

        most = len(messages) - keep - 1  # dropping more would drop the last message
        if most <= 0:
            return ChatPrompt(ids, len(text), images, plan)  # (refused: it cannot fit)
        best = encoded(most)
        if _fits(request, len(best[0]), max_model_len):
            low, high = 1, most  # the fewest dropped that fit: `high` always does
            while low < high:
                middle = (low + high) // 2
                tried = encoded(middle)
                if _fits(request, len(tried[0]), max_model_len):
                    high, best = middle, tried
                else:
                    low = middle + 1
        return ChatPrompt(best[0], len(best[1]), best[2], plan)


def _fits(request: ChatCompletionRequest, prompt_tokens: int, max_model_len: int) -> bool:
    max_tokens, _ = request.requested_max_tokens
    if prompt_tokens >= max_model_len:
        return False
    return max_tokens is None or prompt_tokens + max_tokens <= max_model_len


def _without(messages: Sequence[ChatMessage], keep: int, dropped: int) -> list[ChatMessage]:
    """``messages`` without the ``dropped`` after the first ``keep``, nor the tool results
    that would then lead the rest (their call was dropped)."""
    rest = list(messages[keep + dropped :])
    start = 0
    while start < len(rest) - 1 and rest[start].role == "tool":
        start += 1
    return [*messages[:keep], *rest[start:]]


# ------------------------------------------------------------------ messages as dicts


def template_messages(
    messages: Sequence[ChatMessage], images: list[ImageRef]
) -> list[dict[str, Any]]:
    """Messages as the dicts chat templates expect: string content, optional extras.

    Image parts are appended to ``images`` (in order) instead of the text.

    ``developer`` (OpenAI's newer name for the system role) becomes ``system``: most
    open-model templates predate it.
    """
    rendered = []
    for position, message in enumerate(messages):
        item: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": _content_text(message.content, position, images),
        }
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls is not None:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


def _content_text(
    content: str | list[ContentPart] | None, position: int, images: list[ImageRef]
) -> str:
    """A message's text: text parts joined by newlines (as vLLM joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if part.type == "image_url" and part.image_url is not None:
            images.append(ImageRef(f"messages.{position}.content.{index}", part.image_url.url))
        else:
            texts.append(part.text or "")
    return "\n".join(texts)
