"""Writing your own engine: the contract in docs/engines.md, checked by check_engine.

An engine deals in token ids only: the default graph in front of it renders the chat
template, tokenizes, detokenizes, enforces stop strings and retries lost workers. This one
answers every prompt with the same canned reply, one token per step, and keeps the whole
contract: ``n`` choices, a ``finish_reason`` on each, ``max_tokens``, stop and kill, and
continuing after ``replayed_tokens`` when Migration moves a request to it.

Run it: ``python examples/custom_engine.py``.
"""

from __future__ import annotations

import anyio
from anyio.lowlevel import checkpoint

from operators.contracts.llm import EngineOutput, FinishReason, PreprocessedRequest
from operators.serving import build_app
from operators.testing import check_engine, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, InvalidRequest, Stream


class CannedEngine:
    """Replies ``answer`` (token ids) to every prompt."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        request = ctx.data
        if request.prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        start = request.replayed_tokens  # after a migration: the reply so far is replayed
        rest = self.answer[start:]
        limit = request.stop.max_tokens
        finish: FinishReason = "stop"
        if limit is not None and limit < len(rest):
            rest, finish = rest[:limit], "length"
        for step, token_id in enumerate(rest):
            for index in range(request.n):
                if ctx.is_stopped:  # a stop string matched, or the server drains
                    return
                last = step == len(rest) - 1
                yield EngineOutput([token_id], finish_reason=finish if last else None, index=index)
            await checkpoint()  # let the other requests on this loop run
        if not rest:
            for index in range(request.n):
                yield EngineOutput([], finish_reason=finish, index=index)


async def main() -> None:
    tokenizer = Tokenizer.default()
    answer = tokenizer.encode("Hello from my own engine!")
    await check_engine(lambda: CannedEngine(answer))
    print("CannedEngine passes check_engine")

    app = build_app(CannedEngine(answer), tokenizer, model_name="canned")
    async with openai_client(app) as client:
        reply = await client.chat.completions.create(
            model="canned", messages=[{"role": "user", "content": "Hi!"}], n=2, stop=["!"]
        )
    print([choice.message.content for choice in reply.choices])


if __name__ == "__main__":
    anyio.run(main)
