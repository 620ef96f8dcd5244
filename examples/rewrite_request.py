"""Rewriting a request on its way to the engine, in a graph linked by hand.

An operator rewrites the request it passes downstream, never the one it was given: a new
payload in the same request's Context (``ctx.replace(new)``: the same id, state and
cancellation). What the payload is depends on where the operator sits: above the
preprocessor an OpenAI request (a pydantic model: ``model_copy(update=...)``), below it a
``PreprocessedRequest`` (a dataclass: ``dataclasses.replace``). ``ctx.child(data)`` is for a
leg an operator runs on its own (a retry, a prefill): the request's stop and kill reach
it, its own never reach the request.

The graph is the default one's spine, linked with ``pipeline.link``: preprocessor,
Migration, Backend, and a Router over two echo workers, the first of which dies three
tokens into every request (Migration moves it to the other; the client never notices).

Run it: ``python examples/rewrite_request.py``.
"""

from __future__ import annotations

import dataclasses

import anyio

from operators.backend import Backend
from operators.contracts.llm import BackendOutput, PreprocessedRequest
from operators.edges.openai.events import OpenAIEvent
from operators.edges.openai.preprocessor import OpenAIPreprocessor, OpenAIRequest
from operators.edges.openai.protocol import ChatCompletionRequest, ChatMessage
from operators.edges.openai.server import OpenAIApp
from operators.engines import EchoEngine
from operators.migration import Migration
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, RoundRobin, Router, Stream, WorkerSet, link


class DefaultSystemPrompt:
    """Above the preprocessor: puts a system prompt in front of chats that have none."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt

    async def generate(
        self, ctx: Context[OpenAIRequest], downstream: Engine[OpenAIRequest, OpenAIEvent]
    ) -> Stream[OpenAIEvent]:
        request = ctx.data  # a ChatCompletionRequest or a CompletionRequest
        if isinstance(request, ChatCompletionRequest) and request.messages[0].role != "system":
            system = ChatMessage(role="system", content=self.prompt)
            request = request.model_copy(update={"messages": [system, *request.messages]})
        async for event in downstream.generate(ctx.replace(request)):
            yield event


class AtMost:
    """Below the preprocessor: caps every request's ``max_tokens``."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput]:
        request = ctx.data
        if request.stop.max_tokens is None or request.stop.max_tokens > self.max_tokens:
            stop = dataclasses.replace(request.stop, max_tokens=self.max_tokens)
            request = dataclasses.replace(request, stop=stop)
        async for output in downstream.generate(ctx.replace(request)):
            yield output


async def main() -> None:
    tokenizer = Tokenizer.default()
    workers = WorkerSet(
        "decode",
        {
            "w0": EchoEngine.from_tokenizer(tokenizer, fail_after_tokens=3),
            "w1": EchoEngine.from_tokenizer(tokenizer),
        },
    )
    retries: list[str] = []
    graph = link(
        DefaultSystemPrompt("Be brief."),
        OpenAIPreprocessor(tokenizer, model_name="echo"),
        AtMost(6),  # above Migration: a retry below is invisible to it
        Migration(on_event=lambda where, outcome: retries.append(outcome)),
        Backend(tokenizer),
        Router(workers, RoundRobin()),
    )
    app = OpenAIApp(graph, model_name="echo")
    async with openai_client(app) as client:
        reply = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "Hi there!"}]
        )
    choice = reply.choices[0]
    print(repr(choice.message.content), choice.finish_reason)  # echo: the rendered prompt
    print("lost workers:", retries)


if __name__ == "__main__":
    anyio.run(main)
