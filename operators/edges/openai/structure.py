"""What a chat request asks of the output besides free text: the tools a parser looks for,
and the constraint (:class:`operators.contracts.llm.Constraint`) an engine decodes under.

``response_format`` (a JSON object, or JSON matching a schema) and ``tool_choice``
(``"required"`` or a named function: the output must be valid calls) both become one
engine-agnostic :class:`~operators.contracts.llm.Constraint`; the tool-call format decides how calls
are spelled (``<tool_call>`` tags, ``[TOOL_CALLS]``, ...), so it builds the constraint for
calls. ``tool_choice: "auto"`` constrains nothing: the parser finds calls if the model
makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from operators.contracts.llm import Constraint, Tool
from pipeline import InvalidRequest

from .protocol import ChatCompletionRequest, JsonObjectFormat, JsonSchemaFormat

__all__ = ("ConstraintBuilder", "involves_tools", "output_structure")


class ConstraintBuilder(Protocol):
    """What the preprocessor needs of a tool-call format (:mod:`operators.parsers`): the
    constraint that makes the output valid calls of ``tools`` in that format, or None when
    the format cannot be expressed as one."""

    def constraint(
        self, tools: Sequence[Tool], *, parallel: bool, param: str
    ) -> Constraint | None: ...


def output_structure(
    request: ChatCompletionRequest, tool_format: ConstraintBuilder | None
) -> tuple[tuple[Tool, ...], Constraint | None]:
    """The tools a parser looks for in the output, and the constraint on the output.

    Raises:
        InvalidRequest: tools without a tool-call format, or ``tool_choice`` asking for
            a call the format cannot constrain.
    """
    choice = request.effective_tool_choice
    constraint = None
    response_format = request.response_format
    if isinstance(response_format, JsonSchemaFormat):
        constraint = Constraint(
            param="response_format", json_schema=response_format.json_schema.schema_
        )
    elif isinstance(response_format, JsonObjectFormat):
        constraint = Constraint(param="response_format")
    if choice == "none":
        return (), constraint
    if tool_format is None:
        raise InvalidRequest(
            "this server parses no tool calls (start it with --tool-call-parser)",
            param="tools",
        )
    tools = tuple(tool.as_tool() for tool in request.tools or ())
    if choice in ("required", "named"):
        called = tuple(tool.as_tool() for tool in request.called_tools)
        parallel = choice == "required" and request.parallel_tool_calls is not False
        constraint = tool_format.constraint(called, parallel=parallel, param="tool_choice")
        if constraint is None:
            wanted = "'required'" if choice == "required" else "a named function"
            raise InvalidRequest(
                f"tool_choice {wanted} is not supported with this server's tool-call "
                "format (its calls cannot be expressed as a constraint)",
                param="tool_choice",
            )
    return tools, constraint


def involves_tools(request: ChatCompletionRequest) -> bool:
    """True when the model must see tools: offered ones, earlier calls or their results."""
    if request.tools and request.effective_tool_choice != "none":
        return True
    return any(message.tool_calls or message.role == "tool" for message in request.messages)
