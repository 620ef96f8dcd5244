"""Writing your own engine: a function that yields token ids, made an engine by token_engine.

An engine deals in token ids only: the default graph in front of it renders the chat
template, tokenizes, detokenizes, enforces stop strings and retries lost workers.
``token_engine`` does an engine's own bookkeeping around a function: ``n`` choices, a
``finish_reason`` on each, ``max_tokens``, stop token ids, stop and kill, and continuing
after ``replayed_tokens`` when Migration moves a request to it (docs/engines.md has the
contract, which ``check_engine`` checks). This one answers every prompt with the same
canned reply.

Run it: ``python examples/custom_engine.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio

from operators.contracts.llm import PreprocessedRequest
from operators.engines import TokenEngine, token_engine
from operators.serving import build_app
from operators.testing import check_engine, openai_client
from operators.text.tokenizer import Tokenizer


def canned_engine(answer: list[int]) -> TokenEngine:
    """An engine that replies ``answer`` (token ids) to every prompt."""

    @token_engine
    async def reply(request: PreprocessedRequest) -> AsyncIterator[int]:
        for token_id in answer:  # a model would read request.token_ids and request.sampling
            yield token_id

    return reply


async def main() -> None:
    tokenizer = Tokenizer.default()
    answer = tokenizer.encode("Hello from my own engine!")
    await check_engine(lambda: canned_engine(answer))
    print("canned_engine passes check_engine")

    app = build_app(canned_engine(answer), tokenizer, model_name="canned")
    async with openai_client(app) as client:
        reply = await client.chat.completions.create(
            model="canned", messages=[{"role": "user", "content": "Hi!"}], n=2, stop=["!"]
        )
    print([choice.message.content for choice in reply.choices])


if __name__ == "__main__":
    anyio.run(main)
