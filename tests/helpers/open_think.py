"""A reasoning format for templates that open the reasoning in the prompt (the generation
prompt ends with ``<think>``, as DeepSeek R1's and Qwen 3 thinking models' do), importable
by a ``serve`` subprocess as ``--reasoning-parser tests.helpers.open_think:OPEN_THINK``."""

from __future__ import annotations

from operators.parsers import MarkerReasoningFormat

__all__ = ("OPEN_THINK",)

OPEN_THINK = MarkerReasoningFormat(name="open_think", starts_in_reasoning=True)
