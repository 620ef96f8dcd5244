"""The OpenAI-compatible edge: request models, the preprocessor operator, chat templates.

:mod:`.protocol` validates request bodies (the only pydantic in ``operators``);
:class:`OpenAIPreprocessor` is the operator that tokenizes requests and turns the token
stream back into typed response events (:mod:`.events`); :class:`SseRenderer` renders them
as server-sent events and :func:`aggregate_chat` / :func:`aggregate_completion` fold them
into non-streamed responses. The HTTP server lives in :mod:`.server`.
"""

from __future__ import annotations

from .chat_template import ChatTemplate as ChatTemplate
from .events import ChoiceDelta as ChoiceDelta
from .events import ChoiceStart as ChoiceStart
from .events import OpenAIEvent as OpenAIEvent
from .events import ResponseHead as ResponseHead
from .events import RichDelta as RichDelta
from .events import Usage as Usage
from .events import aggregate_chat as aggregate_chat
from .events import aggregate_completion as aggregate_completion
from .preprocessor import OpenAIPreprocessor as OpenAIPreprocessor
from .preprocessor import TokenizerLike as TokenizerLike
from .protocol import ChatCompletionRequest as ChatCompletionRequest
from .protocol import ChatMessage as ChatMessage
from .protocol import CompletionRequest as CompletionRequest
from .protocol import ContentPart as ContentPart
from .protocol import ImageURL as ImageURL
from .protocol import StreamOptions as StreamOptions
from .protocol import parse_chat_request as parse_chat_request
from .protocol import parse_completion_request as parse_completion_request
from .sse import SseRenderer as SseRenderer
from .sse import stream_chunks as stream_chunks

__all__ = (
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTemplate",
    "ChoiceDelta",
    "ChoiceStart",
    "CompletionRequest",
    "ContentPart",
    "ImageURL",
    "OpenAIEvent",
    "OpenAIPreprocessor",
    "ResponseHead",
    "RichDelta",
    "SseRenderer",
    "StreamOptions",
    "TokenizerLike",
    "Usage",
    "aggregate_chat",
    "aggregate_completion",
    "parse_chat_request",
    "parse_completion_request",
    "stream_chunks",
)
