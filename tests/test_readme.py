"""The README's Python snippets are excerpts of the example files they name.

A snippet starts with ``# examples/NAME.py``; its lines, cut at lines that are just
``...``, must appear in that file in order and verbatim. The examples themselves run in
``test_examples.py``, so a snippet that drifts from running code fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _snippets() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_the_readme_has_snippets() -> None:
    assert len(_snippets()) >= 4


@pytest.mark.parametrize("snippet", _snippets(), ids=lambda s: s.splitlines()[0])
def test_a_snippet_is_an_excerpt_of_its_example(snippet: str) -> None:
    first, _, body = snippet.partition("\n")
    match = re.fullmatch(r"# (examples/\w+\.py)", first)
    assert match, f"a README snippet must start with '# examples/NAME.py', not {first!r}"
    source = (ROOT / match.group(1)).read_text()
    position = 0
    for piece in re.split(r"^\.\.\.\n", body, flags=re.MULTILINE):
        found = source.find(piece, position)
        assert found >= 0, f"not in {match.group(1)} (in this order):\n{piece}"
        position = found + len(piece)
