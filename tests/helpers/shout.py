"""Operators for ``serve --insert-before`` tests, importable as ``tests.helpers.shout:NAME``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from operators.contracts.llm import BackendOutput, PreprocessedRequest
from pipeline import Context, Engine


class Shout:
    """Upper-cases the text on its way back."""

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> AsyncIterator[BackendOutput]:
        async for output in downstream.generate(ctx):
            output.text = output.text.upper()
            yield output


class Exclaim:
    """Appends '!' to every piece of text on its way back."""

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> AsyncIterator[BackendOutput]:
        async for output in downstream.generate(ctx):
            if output.text:
                output.text += "!"
            yield output


def not_an_operator() -> object:
    return "just a string"


def broken() -> Shout:
    raise RuntimeError("no configuration")
