"""The chat messages of a request: roles, content strings or parts, image URLs.

Apart from the request bodies (:mod:`.requests`) because they are the one nested structure
of a request, and what the chat template (:mod:`operators.edges.openai.chat_template`) reads.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from operators.edges.http.schema import ARRAY, STRING, JsonObject, Model, by_shape, kind

__all__ = ("ChatMessage", "ContentPart", "ImageURL")


class ImageURL(Model):
    """The ``image_url`` object of an image content part."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(Model):
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
    Annotated[str, kind(STRING)] | Annotated[list[ContentPart], kind(ARRAY)],
    by_shape(
        "content must be a string or an array of content parts",
        STRING,
        ARRAY,
        error="invalid_content",
    ),
]


class ChatMessage(Model):
    """One message of a chat. ``content`` may be null only for an assistant message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _Content | None = None
    name: str | None = None
    #: an assistant's earlier tool calls, passed to the chat template as they came
    tool_calls: list[JsonObject] | None = None
    #: the call a ``tool`` message answers
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError(
                "missing_content", "a {role} message needs 'content'", {"role": self.role}
            )
        return self
