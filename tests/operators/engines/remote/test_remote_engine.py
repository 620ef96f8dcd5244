"""The remote engine against fake upstreams over real HTTP (``fake_upstream``): the engine
contract for each kind and route, every failure as the error Migration understands, the
abort of every way out, and the fleet's membership following the servers' health."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from operators.contracts.llm import (
    EngineOutput,
    PreprocessedRequest,
)
from operators.engines.remote import RemoteEngine, open_upstreams, parse_upstream
from operators.routing.kv_blocks import block_hashes
from operators.testing import check_engine, make_request
from operators.text.tokenizer import Tokenizer
from pipeline import (
    ConnectFailed,
    Context,
    EngineError,
    InvalidRequest,
    KvCleared,
    KvEvent,
    StreamDisconnected,
    open_stream,
)
from tests.operators.engines.remote.fake_upstream import FakeUpstream, continuation

TOKENIZER = Tokenizer.default()
PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture
def vllm() -> Iterator[FakeUpstream]:
    server = FakeUpstream("vllm")
    yield server
    server.stop()


@pytest.fixture
def llama() -> Iterator[FakeUpstream]:
    server = FakeUpstream("llama-server")
    yield server
    server.stop()


def request(max_tokens: int = 8, n: int = 1, **more: Any) -> PreprocessedRequest:
    prompt = more.pop("prompt", PROMPT)
    return make_request(
        prompt, max_tokens=max_tokens, eos_token_ids=(2,), temperature=0.0, n=n, **more
    )


async def run(engine: RemoteEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    outputs = []
    async with open_stream(engine, Context.new(req)) as stream:
        async for output in stream:
            outputs.append(output)
    return outputs


def tokens(outputs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


async def connect(server: FakeUpstream, **options: Any) -> RemoteEngine:
    return await RemoteEngine.connect(parse_upstream(server.url), tokenizer=TOKENIZER, **options)


async def eventually(condition: Any, what: str) -> None:
    with anyio.fail_after(5, reason=what):
        while not condition():  # noqa: ASYNC110 - the fake's counts change in its own thread
            await anyio.sleep(0.01)


# -- the contract -------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["generate", "completions"])
async def test_the_engine_keeps_the_contract_over_vllm(vllm: FakeUpstream, route: str) -> None:
    vllm.faults.no_generate = route == "completions"
    async with await connect(vllm) as engine:
        assert engine.info.generate is (route == "generate")
        await check_engine(lambda: engine, prompt=PROMPT)
        expected = "/inference/v1/generate" if route == "generate" else "/v1/completions"
        assert {path for path, _ in vllm.counts.bodies} == {expected}


async def test_a_conversation_goes_along_to_a_server_that_may_route_it(
    vllm: FakeUpstream, llama: FakeUpstream
) -> None:
    async with await connect(vllm) as a, await connect(llama) as b:
        for engine in (a, b):
            await run(engine, request(affinity="chat-1"))
            await run(engine, request())
    assert vllm.counts.conversations == ["chat-1", None]
    assert llama.counts.conversations == ["chat-1", None]


async def test_the_engine_keeps_the_contract_over_llama_server(llama: FakeUpstream) -> None:
    async with await connect(llama) as engine:
        assert (engine.info.kind, engine.info.slots) == ("llama-server", 2)
        await check_engine(lambda: engine, prompt=PROMPT)


async def test_the_kind_is_probed_when_the_models_do_not_say(
    vllm: FakeUpstream, llama: FakeUpstream
) -> None:
    vllm.faults.owned_by = llama.faults.owned_by = None
    async with await connect(vllm) as a, await connect(llama) as b:
        assert (a.info.kind, b.info.kind) == ("vllm", "llama-server")


async def test_outputs_are_the_servers_tokens_and_the_cached_prompt(vllm: FakeUpstream) -> None:
    async with await connect(vllm) as engine:
        first = await run(engine, request(max_tokens=6, n=2))
        for index in (0, 1):
            assert tokens(first, index) == continuation(PROMPT, 6)
        assert [o.finish_reason for o in first if o.finish_reason] == ["length", "length"]
        again = await run(engine, request(max_tokens=3))
        assert again[-1].cached_tokens == 16  # the fake's cache: the prompt, in 16-token blocks
        assert engine.statistics().cached_prompt_tokens == 16


async def test_a_replay_continues_after_the_replayed_output(llama: FakeUpstream) -> None:
    whole = continuation(PROMPT, 8)
    async with await connect(llama) as engine:
        replayed = request(max_tokens=5, prompt=PROMPT + whole[:3], replayed_tokens=3)
        assert tokens(await run(engine, replayed)) == whole[3:]


async def test_a_vllm_without_scale_out_is_asked_on_completions_once_refused(
    vllm: FakeUpstream,
) -> None:
    async with await connect(vllm) as engine:
        vllm.faults.no_generate = True  # (a restart without --enable-scale-out)
        assert tokens(await run(engine, request(max_tokens=4))) == continuation(PROMPT, 4)
        assert tokens(await run(engine, request(max_tokens=4))) == continuation(PROMPT, 4)
    paths = [path for path, _ in vllm.counts.bodies]
    assert paths == ["/inference/v1/generate", "/v1/completions", "/v1/completions"]


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["reset_after", "garbage_after", "eof_after", "error_after"])
async def test_a_stream_broken_mid_way_is_a_lost_worker_after_what_it_sent(
    vllm: FakeUpstream, fault: str
) -> None:
    setattr(vllm.faults, fault, 3)
    lost: list[RemoteEngine] = []
    async with await connect(vllm, on_lost=lost.append) as engine:
        outputs: list[EngineOutput] = []
        with pytest.raises(StreamDisconnected):
            async with open_stream(engine, Context.new(request())) as stream:
                async for output in stream:
                    outputs.append(output)
        assert tokens(outputs) == continuation(PROMPT, 3)
        assert lost == [engine]
        assert not engine.up
        assert engine.statistics().lost == 1


async def test_a_server_error_before_any_output_is_a_failed_connect(vllm: FakeUpstream) -> None:
    vllm.faults.status = 503
    async with await connect(vllm) as engine:
        with pytest.raises(ConnectFailed, match="answered 503"):
            await run(engine, request())


async def test_a_refusal_is_the_requests_and_names_the_field(vllm: FakeUpstream) -> None:
    vllm.faults.status = 400
    async with await connect(vllm) as engine:
        with pytest.raises(InvalidRequest, match="answered 400"):
            await run(engine, request())
        assert engine.up  # (the server is fine)


async def test_a_server_gone_is_a_failed_connect(vllm: FakeUpstream) -> None:
    async with await connect(vllm) as engine:
        vllm.stop()
        with pytest.raises(ConnectFailed, match="could not be reached"):
            await run(engine, request())
        assert not engine.up


async def test_a_kind_that_is_neither_is_refused_at_connect(vllm: FakeUpstream) -> None:
    vllm.faults.owned_by = "someone"
    vllm.kind = "other"  # type: ignore[assignment]  # (answers neither /props nor /version)
    with pytest.raises(ValueError, match="--upstream-kind"):
        await connect(vllm)


async def test_a_migrated_constrained_request_fails_rather_than_break_its_grammar(
    vllm: FakeUpstream,
) -> None:
    from operators.contracts.llm import Constraint

    city = Constraint(param="response_format", json_schema={"type": "object"})
    async with await connect(vllm) as engine:
        migrated = request(prompt=[*PROMPT, 300], replayed_tokens=1, constraint=city)
        with pytest.raises(EngineError, match="cannot continue"):
            await run(engine, migrated)


# -- every way out aborts upstream -------------------------------------------------------------


@pytest.mark.parametrize("how", ["kill", "stop", "close"])
async def test_every_way_out_closes_the_upstream_stream(vllm: FakeUpstream, how: str) -> None:
    vllm.delay = 0.05
    async with await connect(vllm) as engine:
        ctx = Context.new(request(max_tokens=1000))
        async with open_stream(engine, ctx) as stream:
            async for _ in stream:
                if how == "kill":
                    ctx.kill()
                elif how == "stop":
                    ctx.stop_generating()
                else:
                    break
        await eventually(lambda: vllm.counts.aborted == 1, "the fake saw its client go")
        assert vllm.counts.running == 0


# -- the fleet --------------------------------------------------------------------------------


async def test_the_fleet_follows_its_servers_health(vllm: FakeUpstream) -> None:
    other = FakeUpstream("vllm")
    try:
        upstreams = [parse_upstream(vllm.url), parse_upstream(other.url)]
        async with open_upstreams(upstreams, poll_interval=0.02) as fleet:
            names = [engine.name for engine in fleet.engines]
            assert [w.id for w in fleet.workers.members] == names
            await eventually(lambda: all(e.load_report() for e in fleet.engines), "a report")
            report = fleet.engines[0].load_report()
            assert report is not None
            assert report.kv_usage == 0.25  # in the router's unit
            said = fleet.engines[0].upstream_load()
            assert said is not None
            assert said.kv_cache_usage == 0.25  # as the server said it
            port = other.port
            other.stop()
            await eventually(lambda: len(fleet.workers) == 1, "the stopped one out")
            other = FakeUpstream("vllm", port=port)
            await eventually(lambda: len(fleet.workers) == 2, "back in once it answers")
            # a lost request takes its server out at once
            vllm.faults.reset_after = 1
            with pytest.raises(StreamDisconnected):
                await run(fleet.engines[0], request())
            assert fleet.engines[0].name not in fleet.workers
    finally:
        other.stop()


async def test_a_server_down_at_start_joins_when_it_answers(vllm: FakeUpstream) -> None:
    late = FakeUpstream("vllm")
    port = late.port
    late.stop()
    upstreams = [parse_upstream(vllm.url), parse_upstream(f"http://127.0.0.1:{port}")]
    async with open_upstreams(upstreams, poll_interval=0.02, connect_timeout=1) as fleet:
        assert len(fleet.workers) == 1
        assert fleet.model == "fake-model"
        late = FakeUpstream("vllm", port=port)
        try:
            await eventually(lambda: len(fleet.workers) == 2, "the late one in")
        finally:
            late.stop()


async def test_no_server_answering_is_a_connection_error() -> None:
    with pytest.raises(ConnectionError, match="no upstream answered"):
        async with open_upstreams([parse_upstream("http://127.0.0.1:9")], connect_timeout=1):
            pass


async def test_a_vllm_servers_kv_events_arrive_as_our_block_ids(vllm: FakeUpstream) -> None:
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    tokens = list(range(1000, 1064))

    def publish(seq: int, *events: dict[str, Any]) -> None:
        payload = msgspec.msgpack.encode([1.0, list(events), 0])
        publisher.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def stored(block: int, parent: int | None, ids: list[int]) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": parent,
                "token_ids": ids, "block_size": 32, "medium": "GPU", "lora_id": None}  # fmt: skip

    received: list[KvEvent] = []
    upstream = parse_upstream(f"{vllm.url},kv=tcp://127.0.0.1:{port}")
    try:
        async with await RemoteEngine.connect(upstream) as engine:
            engine.kv_events = received.append
            publish(0, stored(1, None, tokens[:32]), stored(2, 1, tokens[32:]))
            await eventually(lambda: len(received) == 2, "the stored blocks")
            assert engine.kv_snapshot().block_ids == tuple(block_hashes(tokens, 16))
            publish(0, stored(7, None, tokens[:32]))  # numbered from 0 again: a new server
            await eventually(lambda: len(received) == 4, "a clear, then its block")
            assert isinstance(received[2], KvCleared)
            assert engine.kv_snapshot().block_ids == tuple(block_hashes(tokens[:32], 16))
    finally:
        publisher.close(linger=0)
        context.term()


async def test_an_upstream_without_kv_events_takes_no_sink(vllm: FakeUpstream) -> None:
    async with await connect(vllm) as engine:
        engine.kv_events = print
        assert engine.kv_events is None  # (so the KV router approximates)
