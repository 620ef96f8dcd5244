"""``serve --chat-template FILE --tool-call-parser NAME --reasoning-parser NAME`` (and
``--echo last-message``): the options that shape what the model is shown and how its
output is read, resolved for the graph (:func:`operators.graph.default_stages`).

A parser is a registered name (:mod:`operators.parsers`) or ``MODULE:NAME``: the object
there (a format, or something that makes one when called with no arguments), so a user's
format is served without registering it from a script of their own first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from operators.edges.openai.chat_template import last_message_template
from operators.parsers import (
    ReasoningFormat,
    ToolCallFormat,
    reasoning_parser,
    reasoning_parser_names,
    tool_parser,
    tool_parser_names,
)

if TYPE_CHECKING:
    from operators.graph import GraphOptions

    from .config import ServeConfig

__all__ = ("output_options",)


def output_options(config: ServeConfig) -> GraphOptions:
    """The chat template's source and the parser formats ``config`` names.

    ``--echo last-message`` is a template: the preprocessor renders a chat as its last
    message's text alone, and the echo engine, which sees token ids only, echoes that.

    Raises:
        ValueError: the template file cannot be read, or a parser is neither registered
            nor loadable as ``MODULE:NAME``.
    """
    template = None
    if config.echo == "last-message":  # (check_args: with the echo engine, no other template)
        template = last_message_template()
    elif config.chat_template is not None:
        try:
            template = config.chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read --chat-template {config.chat_template}: {exc}") from exc
    tools: ToolCallFormat | None = None
    if config.tool_call_parser is not None:
        tools = _load(config.tool_call_parser, "--tool-call-parser", tool_parser, tool_parser_names)
    reasoning: ReasoningFormat | None = None
    if config.reasoning_parser is not None:
        reasoning = _load(
            config.reasoning_parser, "--reasoning-parser", reasoning_parser, reasoning_parser_names
        )
    return {"chat_template": template, "tool_call_parser": tools, "reasoning_parser": reasoning}


def _load(spec: str, option: str, registered: Any, names: Any) -> Any:
    if ":" not in spec:
        try:
            return registered(spec)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from exc
    module_name, _, name = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{option}: cannot import {spec}: {exc}") from exc
    if isinstance(found, type) or not _is_format(found):
        try:
            found = found()
        except Exception as exc:  # the user's factory, whatever it raises
            raise ValueError(f"{option}: {spec}() failed: {exc!r}") from exc
    if not _is_format(found):
        raise ValueError(
            f"{option}: {spec} is not a parser format (registered: {', '.join(names())})"
        )
    return found


def _is_format(value: object) -> bool:
    return callable(getattr(value, "parser", None))
