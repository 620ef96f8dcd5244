"""Wire version 4's bursts leave a caching worker's KV events and cached tokens as they were.

A worker given ``coalesce_outputs`` (as ``llm-pipeline worker`` is) merges the token
outputs it sends together. Its engine's prefix cache must not notice: the same requests
publish the same KV events (the frontend's KV router follows them) and report the same
``cached_tokens`` (the client's ``usage.prompt_tokens_details.cached_tokens``) as a worker
that sends every output on its own. The engine is the caching mocker, not vLLM (whose
load alone takes minutes here): the cache, its events and the first output's
``cached_tokens`` are the same contract (``NatsKvPublisher`` over ``KvReporter``), and at
zero step time every token of a request is ready at once, so the merging is the most the
worker can do.
"""

from __future__ import annotations

from typing import NamedTuple

import anyio
import pytest

pytest.importorskip("nats", reason="the NATS tests need the nats extra: pip install -e '.[nats]'")

from nats.aio.client import Client
from nats.aio.msg import Msg

from operators.backend import CACHED_TOKENS, Backend
from operators.contracts.llm import BackendOutput, EngineOutput, PreprocessedRequest, StopConditions
from operators.contracts.transport import coalesce_outputs, llm_codec
from operators.engines.mocker import MockerEngine
from pipeline import link
from pipeline.kv_events import KvEvent, event_from_dict
from pipeline.testing import collect, make_context
from pipeline.transports.nats import NatsKvPublisher, NatsTimeouts, RemoteEngine, kv_subject, serve
from pipeline.transports.nats.wire import control_codec
from tests.helpers.byte_tokenizer import ByteTokenizer
from tests.pipeline.transports.nats.test_nats_batching import bounds

pytestmark = pytest.mark.slow  # every test starts a nats-server

MODEL = "m"
WORKER = "w"
QUIET = NatsTimeouts(ttl=1, heartbeat=60.0, drain=2.0)
BLOCK = 8
TOKENIZER = ByteTokenizer()


def prompt(text: str) -> list[int]:
    return TOKENIZER.tokenize([bytes([byte]) for byte in text.encode()])


FIRST = "The quick brown fox jumps over the lazy dog, twice. "  # 6 blocks and a bit
#: a conversation's turns, then a stranger that evicts part of it, then the first again
TURNS = [
    prompt(FIRST),
    prompt(FIRST + "And then? It sleeps."),
    prompt("Pack my box with five dozen liquor jugs, said the sphinx."),
    prompt(FIRST),
]


class Served(NamedTuple):
    """What one worker's run gave: per request, and the KV events it published."""

    outputs: list[list[EngineOutput]]  # as the client's RemoteEngine received them
    seen: list[tuple[str, list[int], str | None, int | None]]  # text, ids, finish, cached
    events: list[KvEvent]


async def run(nc: Client, worker_nc: Client, *, merging: bool) -> Served:
    """Serve :data:`TURNS` one after another through a fresh caching mocker worker."""
    engine = MockerEngine(
        prefill_ms_per_token=0, decode_ms_per_step=0, block_size=BLOCK, cache_blocks=10
    )
    events: list[KvEvent] = []

    async def on_events(msg: Msg) -> None:
        events.extend(event_from_dict(plain) for plain in control_codec.decode(msg.data)["events"])

    subscription = await nc.subscribe(kv_subject(MODEL, WORKER), cb=on_events)
    await nc.flush()
    publisher = NatsKvPublisher(engine, nc=worker_nc, model=MODEL, worker_id=WORKER)
    outputs: list[list[EngineOutput]] = []
    seen: list[tuple[str, list[int], str | None, int | None]] = []
    codec = llm_codec()
    with bounds():  # no hold-time bound: what is ready together goes together
        async with anyio.create_task_group() as tg:
            await tg.start(publisher.run)
            assert publisher.active
            async with serve(
                engine,
                nc=worker_nc,
                model=MODEL,
                worker_id=WORKER,
                codec=codec,
                timeouts=QUIET,
                register=False,
                coalesce=coalesce_outputs if merging else None,
            ) as worker:
                remote: RemoteEngine[PreprocessedRequest, EngineOutput] = RemoteEngine(
                    nc, worker_id=worker.worker_id, codec=codec, timeouts=QUIET
                )
                for number, ids in enumerate(TURNS):
                    request = PreprocessedRequest(
                        token_ids=ids, stop=StopConditions(max_tokens=24 + number)
                    )
                    outputs.append(await collect(remote, make_context(request)))
                    ctx = make_context(request)
                    backend: list[BackendOutput] = await collect(
                        link(Backend(TOKENIZER), remote), ctx
                    )
                    seen.append(
                        (
                            "".join(o.text for o in backend),
                            [i for o in backend for i in o.token_ids],
                            backend[-1].finish_reason,
                            ctx.state.get(CACHED_TOKENS, None),
                        )
                    )
            last = engine.kv_snapshot().seq  # every event made, numbered
            with anyio.fail_after(5):  # published by the publisher's task, then delivered
                while not events or events[-1].seq < last:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    await subscription.unsubscribe()
    return Served(outputs, seen, events)


def ids_of(outputs: list[EngineOutput]) -> list[int]:
    return [i for output in outputs for i in output.token_ids]


def cached(outputs: list[EngineOutput]) -> list[int]:
    return [output.cached_tokens for output in outputs if output.cached_tokens is not None]


async def test_merging_leaves_the_kv_events_and_cached_tokens_unchanged(
    nc: Client, worker_nc: Client
) -> None:
    one_by_one = await run(nc, worker_nc, merging=False)
    merged = await run(nc, worker_nc, merging=True)

    # The worker merged: each turn's tokens (its first ask, read raw) crossed in fewer outputs.
    for alone, bursts in zip(one_by_one.outputs, merged.outputs, strict=True):
        assert ids_of(bursts) == ids_of(alone)
        assert len(alone) == len(ids_of(alone))  # one output per token
        assert len(bursts) < len(alone) // 2
        assert [o.finish_reason for o in bursts][-1] == "length"
    # ... and the cache saw the same requests: the same events, the same hits reported.
    assert merged.events == one_by_one.events
    kinds = {type(event).__name__ for event in merged.events}
    assert kinds == {"KvStored", "KvRemoved"}  # the stranger evicted part of the first turn
    assert [cached(o) for o in merged.outputs] == [cached(o) for o in one_by_one.outputs]
    assert merged.seen == one_by_one.seen
    # The hits, as a client reads them (a prompt's full blocks are cached): first asks cold,
    # the conversation's next turn hits the first turn's 6 blocks, the stranger nothing, the
    # first turn again the 3 blocks the stranger left of it (10 blocks: it took 7) ...
    assert [cached(o) for o in merged.outputs] == [[0], [6 * BLOCK], [0], [3 * BLOCK]]
    # ... and every second ask all its full blocks.
    assert [hit for *_, hit in merged.seen] == [len(ids) // BLOCK * BLOCK for ids in TURNS]
