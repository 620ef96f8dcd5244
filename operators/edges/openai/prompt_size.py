"""How large a request's prompts are before they are rendered or encoded, and what that rules out.

Why: rendering and encoding cost time and memory in proportion to the prompt (a 20 MB prompt
is ~5M tokens and seconds of work), and for most of them the answer is known in advance. A
token stands for at most ``max_token_chars`` characters (the longest vocabulary entry), so a
text of N characters has at least ``ceil(N / max_token_chars)`` tokens: when that alone does
not fit the context, the request is refused at once, with the same 400 and ``param`` the
exact count would give. A request that may fit but is large is prepared off the event loop
(:class:`~operators.edges.openai.preprocessor.OpenAIPreprocessor`), so it never stalls the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from pipeline import InvalidRequest

from .protocol import ChatCompletionRequest, CompletionRequest

__all__ = ("OFF_LOOP_CHARS", "PromptSize", "prompt_sizes", "refuse_unfittable")

#: prompts with more characters (or token ids) than this are prepared in a worker thread
OFF_LOOP_CHARS: Final = 32_768


@dataclass(frozen=True, slots=True)
class PromptSize:
    """One prompt of a request, measured without encoding it."""

    #: the request field the prompt came from: ``messages``, ``prompt`` or ``prompt.3``
    param: str
    #: characters of text (all messages' text for chat), or token ids when ``exact``
    size: int
    #: True for a prompt given as token ids: ``size`` is its token count
    exact: bool = False

    def least_tokens(self, max_token_chars: int) -> int:
        """A lower bound on the prompt's token count."""
        return self.size if self.exact else -(-self.size // max(1, max_token_chars))


def prompt_sizes(request: ChatCompletionRequest | CompletionRequest) -> list[PromptSize]:
    """The prompts of ``request`` with their sizes (one for chat, one per completions prompt)."""
    if isinstance(request, ChatCompletionRequest):
        chars = 0
        for message in request.messages:
            content = message.content
            if isinstance(content, str):
                chars += len(content)
            elif content is not None:
                chars += sum(len(part.text or "") for part in content)
        return [PromptSize("messages", chars)]
    prompts = request.prompts
    batch = len(prompts) > 1
    return [
        PromptSize(
            f"prompt.{position}" if batch else "prompt", len(prompt), not isinstance(prompt, str)
        )
        for position, prompt in enumerate(prompts)
    ]


def refuse_unfittable(
    request: ChatCompletionRequest | CompletionRequest,
    sizes: list[PromptSize],
    *,
    max_model_len: int | None,
    max_token_chars: int | None,
) -> None:
    """Refuse ``request`` when one of its prompts cannot fit ``max_model_len`` whatever its
    exact token count.

    Prompts given as token ids are left to the exact check (they need no encoding).

    Raises:
        InvalidRequest: the prompt alone, or the prompt plus ``max_tokens``, exceeds the
            context; ``param`` names the prompt or the output limit, as the exact check does.
    """
    if max_model_len is None or not max_token_chars:
        return
    max_tokens, max_param = request.requested_max_tokens
    for prompt in sizes:
        if prompt.exact:
            continue
        least = prompt.least_tokens(max_token_chars)
        what = "messages" if prompt.param == "messages" else "prompt"
        counted = f"at least {least} tokens ({prompt.size} characters)"
        if least >= max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens, but the "
                f"{what} has {counted}, which leaves no room for a completion. "
                f"Shorten the {what}.",
                param=prompt.param,
            )
        if max_tokens is not None and least + max_tokens > max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested at least {least + max_tokens} tokens ({counted} in the {what}, "
                f"{max_tokens} for the completion). Reduce the length of the {what} or "
                f"'{max_param}'.",
                param=max_param,
            )
