"""A :class:`~operators.contracts.llm.Constraint` as a Lark grammar for llguidance, for every engine
that masks with it (the llama engine directly, the vLLM engine through vLLM's "guidance"
structured-output backend), so that both constrain the same output the same way.

The output's shape is ``prefix JSON suffix`` (``repeat``: one or more joined by
``separator``), a Lark grammar around llguidance's ``%json``. Whitespace inside the JSON is
fixed to ``", "`` and ``": "``: free whitespace lets a small model emit newlines until
``max_tokens`` (SmolLM2 did, under vLLM's default JSON grammar too), and this is the spacing
models have seen most.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from operators.contracts.llm import Constraint

__all__ = ("lark_grammar",)

#: llguidance's JSON options: no free whitespace (see the module docstring)
_JSON_STYLE: Final[Mapping[str, Any]] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def lark_grammar(constraint: Constraint) -> str:
    """The Lark grammar of ``constraint``'s output, for llguidance.

    The JSON is llguidance's ``%json`` of the schema (any object when None); literal texts
    are Lark strings (JSON's escapes are Lark's).
    """
    schema: dict[str, Any] = (
        {"type": "object"} if constraint.json_schema is None else dict(constraint.json_schema)
    )
    schema["x-guidance"] = {**_JSON_STYLE, **dict(schema.get("x-guidance") or {})}
    piece = " ".join(
        part for part in (_literal(constraint.prefix), "value", _literal(constraint.suffix)) if part
    )
    if constraint.repeat:
        start = f"start: piece ({_literal(constraint.separator)} piece)*"
    else:
        start = "start: piece"
    return f"{start}\npiece: {piece}\nvalue: %json {json.dumps(schema)}\n"


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""
