"""A NATS worker with a mocker prefix cache in its own process, so a test can ``kill -9`` it.

    python -m tests.pipeline.transports.nats.kv_worker_process URL WORKER_ID TTL

It serves a :class:`MockerEngine` (block size :data:`BLOCK_SIZE`, caching) for model
:data:`MODEL`, publishes its KV events, and prints ``ready`` once it is registered.
"""

from __future__ import annotations

import sys

import anyio

from operators.contracts.transport import llm_codec
from operators.engines.mocker import MockerEngine
from pipeline.transports.nats import NatsKvPublisher, NatsTimeouts, connect, serve

__all__ = ("BLOCK_SIZE", "MODEL")

MODEL = "caching"
BLOCK_SIZE = 4


async def main(url: str, worker_id: str, ttl: float) -> None:
    engine = MockerEngine(
        worker_id=worker_id, block_size=BLOCK_SIZE, cache_blocks=64, decode_ms_per_step=1.0
    )
    nc = await connect(url)
    publisher = NatsKvPublisher(engine, nc=nc, model=MODEL, worker_id=worker_id)
    worker = serve(
        engine,
        nc=nc,
        model=MODEL,
        worker_id=worker_id,
        codec=llm_codec(),
        timeouts=NatsTimeouts(ttl=ttl),
    )
    async with anyio.create_task_group() as tg:
        await tg.start(publisher.run)  # snapshots are answered before the worker registers
        async with worker:
            print("ready", flush=True)  # noqa: T201
            await worker.serve_forever()
        tg.cancel_scope.cancel()
    await nc.close()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], float(sys.argv[3]))
