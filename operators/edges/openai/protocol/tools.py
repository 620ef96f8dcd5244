"""Tool definitions, ``tool_choice`` and ``response_format``: what a chat request may ask the
model to produce besides free text.

Apart from the request bodies (:mod:`.requests`) because they are the parts of a request
that turn into engine constraints (:class:`operators.contracts.llm.Constraint`) and into what a
tool-call parser looks for (:class:`operators.contracts.llm.Tool`), not into sampling parameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from operators.contracts.llm import Tool
from operators.edges.http.schema import (
    OBJECT,
    STRING,
    Bool,
    JsonObject,
    Model,
    by_shape,
    by_type,
    kind,
)

__all__ = (
    "FunctionDefinition",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "TextFormat",
    "ToolChoice",
    "ToolDefinition",
)

#: OpenAI's rule for function names (what templates and parsers may rely on)
_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class FunctionDefinition(Model):
    """``tools[i].function``: a function the model may call."""

    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    #: the arguments' JSON schema (an object schema); None: any object
    parameters: JsonObject | None = None
    strict: Bool | None = None


class ToolDefinition(Model):
    """``tools[i]``: only function tools exist in the chat API."""

    type: Literal["function"]
    function: FunctionDefinition

    def as_tool(self) -> Tool:
        """The engine-side record of this tool."""
        function = self.function
        return Tool(
            name=function.name, description=function.description, parameters=function.parameters
        )

    def as_template_dict(self) -> dict[str, Any]:
        """The tool as chat templates expect it (``apply_chat_template(tools=...)``)."""
        return self.model_dump(mode="json", exclude_none=True)


class NamedFunction(Model):
    """``tool_choice.function``: which function must be called."""

    name: str


class NamedToolChoice(Model):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], kind(STRING)]
    | Annotated[NamedToolChoice, kind(OBJECT)],
    by_shape(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        STRING,
        OBJECT,
        error="invalid_tool_choice",
    ),
]
"""``tool_choice``: a mode, or the one function that must be called."""


class TextFormat(Model):
    """``response_format: {"type": "text"}``: free text (the default)."""

    type: Literal["text"]


class JsonObjectFormat(Model):
    """``response_format: {"type": "json_object"}``: any JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(Model):
    """``response_format.json_schema``. ``schema`` is spelled ``schema_`` here: pydantic's
    models have a ``schema`` method of their own."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    schema_: JsonObject = Field(default_factory=dict, alias="schema")
    strict: Bool | None = None


class JsonSchemaFormat(Model):
    """``response_format: {"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    Annotated[TextFormat, kind("text")]
    | Annotated[JsonObjectFormat, kind("json_object")]
    | Annotated[JsonSchemaFormat, kind("json_schema")],
    by_type(
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        ("text", "json_object", "json_schema"),
        error="invalid_response_format",
    ),
]
"""``response_format``: text, any JSON object, or JSON matching a schema."""
