"""A NATS worker in its own process, so that a test can ``kill -9`` it.

    python -m tests.pipeline.transports.nats.worker_process URL WORKER_ID TTL

It serves :class:`Countdown` for model ``"counting"`` and prints ``ready`` once it is
registered.
"""

from __future__ import annotations

import sys

import anyio

from operators.contracts.llm import (
    EngineOutput,
    PreprocessedRequest,
)
from operators.contracts.transport import llm_codec
from pipeline import Context, Stream
from pipeline.transports.nats import NatsTimeouts, serve

__all__ = ("CODEC", "MODEL", "SCRIPT", "Countdown")

MODEL = "counting"
#: the token ids every request generates: "abcdefghijklmnopqrst"
SCRIPT = list(range(ord("a"), ord("t") + 1))
#: the codec the LLM layer uses for its request and output types
CODEC = llm_codec()


class Countdown:
    """Generates :data:`SCRIPT` after the prompt, one token per ``delay`` seconds.

    It honours ``replayed_tokens`` like a real model: a migrated request continues where
    the lost worker stopped.
    """

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay
        self.requests: list[PreprocessedRequest] = []

    async def generate(self, ctx: Context[PreprocessedRequest]) -> Stream[EngineOutput]:
        request = ctx.data
        self.requests.append(request)
        done = request.replayed_tokens
        for token_id in SCRIPT[done:]:
            await anyio.sleep(self.delay)
            if ctx.is_stopped:
                return
            last = token_id == SCRIPT[-1]
            yield EngineOutput(token_ids=[token_id], finish_reason="length" if last else None)


async def main(url: str, worker_id: str, ttl: float) -> None:
    timeouts = NatsTimeouts(ttl=ttl)
    worker = serve(
        Countdown(), url=url, model=MODEL, worker_id=worker_id, codec=CODEC, timeouts=timeouts
    )
    async with worker:
        print("ready", flush=True)  # noqa: T201
        await worker.serve_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], float(sys.argv[3]))
