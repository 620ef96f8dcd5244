"""Output parsers: reasoning and tool calls out of the model's text, per choice.

Models write their reasoning and their tool calls as text with markup (``<think>``,
``<tool_call>{...}</tool_call>``, ``[TOOL_CALLS][...]``); OpenAI's API shows them as
``reasoning_content`` and ``tool_calls``. This package does the translation the way the
Backend handles stop strings: markup is withheld exactly while it may still be markup
(a marker split across tokens never leaks a byte; other text is released at once), and
the result does not depend on how the text was cut into tokens.

* **Formats** (:class:`ToolCallFormat`, :class:`ReasoningFormat`) describe a model
  family's spelling and make one sans-IO parser per choice; the built-ins are registered
  by name (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``; ``think``), and a user's
  format is registered the same way (:func:`register_tool_parser`), usually as a
  :class:`MarkerToolFormat` in one line.
* **The operator** :class:`OutputParsers` runs them in a graph, above Migration, keeping
  logprobs aligned with what the client has read.
* A tool-call format also builds the :class:`~operators.contracts.llm.Constraint` that forces calls
  (``tool_choice: "required"`` or a named function) on engines that decode under one.
"""

from __future__ import annotations

from .base import Parsed as Parsed
from .base import ReasoningFormat as ReasoningFormat
from .base import ReasoningParser as ReasoningParser
from .base import ToolCallFormat as ToolCallFormat
from .base import ToolParser as ToolParser
from .base import call_pieces as call_pieces
from .base import checked_calls as checked_calls
from .base import new_call_id as new_call_id
from .choice import ChoiceParser as ChoiceParser
from .leading import JsonToolFormat as JsonToolFormat
from .leading import PythonicToolFormat as PythonicToolFormat
from .marker import MarkerToolFormat as MarkerToolFormat
from .output_parsers import CallIds as CallIds
from .output_parsers import OutputParsers as OutputParsers
from .reasoning import MarkerReasoningFormat as MarkerReasoningFormat
from .registry import HERMES as HERMES
from .registry import LLAMA3_JSON as LLAMA3_JSON
from .registry import MISTRAL as MISTRAL
from .registry import PYTHONIC as PYTHONIC
from .registry import THINK as THINK
from .registry import reasoning_parser as reasoning_parser
from .registry import reasoning_parser_names as reasoning_parser_names
from .registry import register_reasoning_parser as register_reasoning_parser
from .registry import register_tool_parser as register_tool_parser
from .registry import tool_parser as tool_parser
from .registry import tool_parser_names as tool_parser_names

__all__ = (
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "PYTHONIC",
    "THINK",
    "CallIds",
    "ChoiceParser",
    "JsonToolFormat",
    "MarkerReasoningFormat",
    "MarkerToolFormat",
    "OutputParsers",
    "Parsed",
    "PythonicToolFormat",
    "ReasoningFormat",
    "ReasoningParser",
    "ToolCallFormat",
    "ToolParser",
    "call_pieces",
    "checked_calls",
    "new_call_id",
    "reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
    "register_tool_parser",
    "tool_parser",
    "tool_parser_names",
)
