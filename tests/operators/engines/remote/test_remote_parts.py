"""The remote engine's parts that need no server: ``--upstream`` parsing, each kind's
request mapping and refusals, the stream readers (held finish, logprobs, llama-server's
left-out tokens), the upstreams' failures as our errors, load reports, and the KV event
decoder that needs no vLLM."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from operators.contracts.llm import (
    Constraint,
    PreprocessedRequest,
)
from operators.engines._vllm_kv_events import BlockTranslator, event_batch_type
from operators.engines.remote import UpstreamInfo, UpstreamLoad, parse_upstream
from operators.engines.remote._gaps import GapFiller
from operators.engines.remote._http import DONE, mid_stream, refusal
from operators.engines.remote._llama import LlamaReader, llama_call
from operators.engines.remote._load import llama_load, vllm_load
from operators.engines.remote._vllm import VllmReader, vllm_call
from operators.engines.vllm._sampling import EngineLimits
from operators.routing.kv_blocks import block_hashes
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer
from pipeline import (
    CapacityExhausted,
    ConnectFailed,
    EngineError,
    InvalidRequest,
    KvStored,
    StreamDisconnected,
    WorkerLoad,
)

TOKENIZER = Tokenizer.default()
LIMITS = EngineLimits(vocab_size=49152, max_model_len=64, eos_token_ids=(2,))
VLLM = UpstreamInfo("vllm", "smol", max_model_len=64, generate=True)
LLAMA = UpstreamInfo("llama-server", "/models/smol.gguf", max_model_len=64, slots=2)


def request(
    prompt: list[int] | None = None,
    *,
    n: int = 1,
    logprobs: int | None = None,
    max_tokens: int | None = 8,
    **more: Any,
) -> PreprocessedRequest:
    """A greedy request for [5, 6, 7] (EOS 2) unless told otherwise: ``make_request``'s
    keywords (``temperature``, ``seed``, ``min_tokens``, ``constraint``, ...)."""
    more.setdefault("temperature", 0.0)
    return make_request(
        [5, 6, 7] if prompt is None else prompt,
        n=n,
        logprobs=logprobs,
        max_tokens=max_tokens,
        eos_token_ids=(2,),
        **more,
    )


# -- --upstream ------------------------------------------------------------------------------


def test_an_upstream_is_a_root_url_with_an_optional_kv_endpoint() -> None:
    plain = parse_upstream("http://10.0.0.5:8000/")
    assert (plain.url, plain.kind, plain.kv_events, plain.name) == (
        "http://10.0.0.5:8000", None, None, "10.0.0.5:8000"
    )  # fmt: skip
    events = parse_upstream("http://h:1,kv=tcp://h:5557", "vllm")
    assert (events.kind, events.kv_events) == ("vllm", "tcp://h:5557")


@pytest.mark.parametrize(
    "text",
    ["h:8000", "ftp://h", "http://", "http://h:1?x=1", "http://h:1,kv=h:5", "http://h:1,zmq=x",
     "http://h:1,kv=tcp://*:5557", "http://h:1,kv=tcp://h"],
)  # fmt: skip
def test_a_wrong_upstream_is_refused_with_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected|takes|connects|root"):
        parse_upstream(text)


# -- vLLM: the request ------------------------------------------------------------------------


def test_the_generate_route_gets_vllms_own_sampling_params() -> None:
    call = vllm_call(request(logprobs=3, priority=2), "r", VLLM, LIMITS, generate=True)
    assert call.path == "/inference/v1/generate"
    assert call.body["token_ids"] == [5, 6, 7]
    params = call.body["sampling_params"]
    assert params["max_tokens"] == 8
    assert params["temperature"] == 0.0
    assert params["stop_token_ids"] == [2]
    assert params["detokenize"] is False
    assert params["logprobs"] == 4  # one more: the sampled token may crowd out the 3rd best
    assert call.body["priority"] == 2
    assert call.body["stream_options"] == {"include_usage": True}


def test_the_completions_route_gets_a_token_prompt_and_ids_back() -> None:
    call = vllm_call(request(logprobs=2), "r", VLLM, LIMITS, generate=False)
    body = call.body
    assert call.path == "/v1/completions"
    assert body["model"] == "smol"
    assert body["prompt"] == [5, 6, 7]
    assert body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 2
    assert "detokenize" not in body
    assert "priority" not in body


def test_greedy_n_above_one_is_top_k_one_as_vllm_takes_it() -> None:
    params = vllm_call(request(n=2), "r", VLLM, LIMITS, generate=True).body["sampling_params"]
    assert (params["n"], params["temperature"], params["top_k"]) == (2, 1.0, 1)


def test_a_structured_request_carries_its_grammar_and_a_migrated_one_is_refused() -> None:
    city = Constraint(param="response_format", json_schema={"type": "object"})
    call = vllm_call(request(constraint=city), "r", VLLM, LIMITS, generate=True)
    assert "%json" in call.body["sampling_params"]["structured_outputs"]["grammar"]
    migrated = request([5, 6, 7, 8], constraint=city, replayed_tokens=1)
    with pytest.raises(EngineError, match="cannot continue"):
        vllm_call(migrated, "r", VLLM, LIMITS, generate=True)


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (request([]), "prompt"),
        (request([5, 99999]), "prompt"),
        (request(max_tokens=100), "max_tokens"),
        (request(logprobs=50), "logprobs"),
        (request(temperature=-1.0), "temperature"),
    ],
)
def test_what_vllm_cannot_take_is_refused_by_name_before_it_is_sent(
    req: PreprocessedRequest, param: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        vllm_call(req, "r", VLLM, LIMITS, generate=True)
    assert caught.value.param == param


# -- vLLM: the stream -------------------------------------------------------------------------


def chunk(index: int, ids: list[int], finish: str | None = None, **more: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "token_ids": ids, "finish_reason": finish, **more}]}


def test_the_last_finish_waits_for_the_usage_and_carries_the_cached_tokens() -> None:
    reader = VllmReader(2, None, "r")
    assert [o.token_ids for o in reader.feed(chunk(0, [7]))] == [[7]]
    [first_done] = reader.feed(chunk(0, [8], "stop"))
    assert first_done.finish_reason == "stop"
    assert first_done.cached_tokens is None
    assert reader.feed(chunk(1, [9], "length")) == []  # the last one: held
    usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
    [last] = reader.feed(usage)
    assert (last.index, last.token_ids, last.finish_reason, last.cached_tokens) == (
        1, [9], "length", 32
    )  # fmt: skip
    assert reader.done
    assert reader.generated == 3


def test_without_usage_the_held_finish_comes_at_done_without_cached_tokens() -> None:
    reader = VllmReader(1, None, "r")
    assert reader.feed(chunk(0, [7], "stop")) == []
    [last] = reader.feed(DONE)
    assert last.finish_reason == "stop"
    assert last.cached_tokens is None


def test_a_stream_that_ends_before_every_choice_finished_is_a_lost_worker() -> None:
    reader = VllmReader(2, None, "r")
    reader.feed(chunk(0, [7], "stop"))
    with pytest.raises(StreamDisconnected, match=r"choices \[1\]"):
        reader.end()


def test_an_aborted_choice_is_lost_and_an_unknown_finish_fails() -> None:
    with pytest.raises(StreamDisconnected):
        VllmReader(1, None, "r").feed(chunk(0, [], "abort"))
    with pytest.raises(EngineError, match="'error'"):
        VllmReader(1, None, "r").feed(chunk(0, [], "error"))


def test_generate_logprobs_keep_the_k_best_whatever_the_sampled_token() -> None:
    content = [
        {"token_id": 9, "logprob": -3.0, "top_logprobs": [  # sampled, not among the 2 best
            {"token_id": 9, "logprob": -3.0, "rank": 4},
            {"token_id": 1, "logprob": -0.5, "rank": 1},
            {"token_id": 4, "logprob": -1.0, "rank": 2},
        ]},
    ]  # fmt: skip
    [output] = VllmReader(1, 2, "r").feed(chunk(0, [9], logprobs={"content": content}))
    assert output.logprobs == [-3.0]
    assert output.top_logprobs == [[(1, -0.5), (4, -1.0)]]


def test_completion_logprobs_read_ids_from_their_keys() -> None:
    logprobs = {
        "token_logprobs": [-0.25],
        "top_logprobs": [{"token_id:7": -0.25, "token_id:3": -2.0, "token_id:5": -1.5}],
    }
    [output] = VllmReader(1, 2, "r").feed(chunk(0, [7], logprobs=logprobs))
    assert output.logprobs == [-0.25]
    assert output.top_logprobs == [[(7, -0.25), (5, -1.5)]]


def test_an_error_event_is_the_requests_fault_or_a_lost_server() -> None:
    with pytest.raises(InvalidRequest) as caught:
        VllmReader(1, None, "r").feed({"error": {"message": "bad seed", "code": 400}})
    assert caught.value.param == "seed"
    with pytest.raises(StreamDisconnected):
        VllmReader(1, None, "r").feed({"error": {"message": "EngineDeadError", "code": 500}})


# -- the upstream's answers as our errors ------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "error", "param"),
    [
        (400, b'{"error": {"message": "priority is not supported", "code": 400}}',
         InvalidRequest, "priority"),
        (400, b'{"error": {"message": "x", "param": "top_logprobs"}}', InvalidRequest, "logprobs"),
        (422, b"not json", InvalidRequest, None),
        (429, b"{}", CapacityExhausted, None),
        (500, b"{}", ConnectFailed, None),
        (503, b"<html>", ConnectFailed, None),
        (401, b"{}", EngineError, None),
    ],
)  # fmt: skip
def test_an_upstream_status_becomes_our_error(
    status: int, body: bytes, error: type[Exception], param: str | None
) -> None:
    found = refusal(status, body, "r")
    assert type(found) is error
    assert f"answered {status}" in str(found)
    if isinstance(found, InvalidRequest):
        assert found.param == param


def test_a_mid_stream_error_without_a_code_is_a_lost_server() -> None:
    assert isinstance(mid_stream({"error": "boom"}, "r"), StreamDisconnected)


# -- llama-server ------------------------------------------------------------------------------


def test_llama_server_gets_every_sampler_it_would_otherwise_default() -> None:
    body = llama_call(request(logprobs=0, n=2, seed=7), "r", LLAMA, LIMITS).body
    assert body["prompt"] == [5, 6, 7]
    assert body["n_predict"] == 8 + 3  # (cut at 8 by the reader: see the next test)
    assert body["n_cmpl"] == 2
    assert (body["top_k"], body["top_p"], body["min_p"], body["repeat_penalty"]) == (
        1,
        1.0,
        0.0,
        1.0,
    )
    assert body["return_tokens"] is True
    assert body["stream"] is True
    assert body["n_probs"] == 1
    assert body["seed"] == 7
    plain = llama_call(request(), "r", LLAMA, LIMITS).body
    assert plain["top_k"] == 0
    assert "n_cmpl" not in plain
    assert "n_probs" not in plain


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (request(min_tokens=2), "min_tokens"),
        (request(n=3), "n"),
        (request(priority=1), "priority"),
        (request(seed=2**32), "seed"),
        (request(constraint=Constraint(param="tool_choice", prefix="<tool_call>")), "tool_choice"),
    ],
)
def test_what_llama_server_cannot_take_is_refused_by_name(
    req: PreprocessedRequest, param: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        llama_call(req, "r", LLAMA, LIMITS)
    assert caught.value.param == param
    assert "llama-server" in caught.value.message


def test_a_json_constraint_is_llama_servers_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    city = Constraint(param="response_format", json_schema=schema)
    assert llama_call(request(constraint=city), "r", LLAMA, LIMITS).body["json_schema"] == schema


def llama_chunk(ids: list[int], predicted: int, **more: Any) -> dict[str, Any]:
    return {"index": 0, "tokens": ids, "stop": False, "tokens_predicted": predicted, **more}


def test_llama_server_chunks_report_cached_tokens_first_and_the_stop_type_last() -> None:
    reader = LlamaReader(1, None, "r", None)
    assert reader.feed({"index": 0, "content": "", "tokens": [], "stop": False}) == []
    [first] = reader.feed(llama_chunk([504], 1, timings={"cache_n": 15}))
    assert (first.token_ids, first.cached_tokens) == ([504], 15)
    [second] = reader.feed(llama_chunk([2], 2, timings={"cache_n": 15}))
    assert second.cached_tokens is None
    [end] = reader.feed({"index": 0, "stop": True, "stop_type": "eos", "tokens": []})
    assert (end.token_ids, end.finish_reason) == ([], "stop")
    assert reader.done
    with pytest.raises(EngineError, match="stop_type"):
        LlamaReader(1, None, "r", None).feed({"index": 0, "stop": True, "stop_type": "none"})


def test_tokens_llama_server_leaves_out_are_recovered_from_the_text() -> None:
    ids = TOKENIZER.encode("🥳", parse_special=False)
    assert len(ids) > 1  # an emoji is several tokens: all but the last are left out
    reader = LlamaReader(1, None, "r", GapFiller(TOKENIZER))
    [output] = reader.feed(llama_chunk([ids[-1]], len(ids), content="🥳"))
    assert output.token_ids == ids
    with pytest.raises(EngineError, match="no logprobs"):
        LlamaReader(1, 1, "r", GapFiller(TOKENIZER)).feed(
            llama_chunk([ids[-1]], len(ids), content="🥳", completion_probabilities=[])
        )


def test_the_budget_is_cut_by_the_reader_whole_characters_included() -> None:
    text, emoji = TOKENIZER.encode("Hi", parse_special=False), TOKENIZER.encode("🥳")
    whole = len(text) + len(emoji)
    reader = LlamaReader(1, None, "r", GapFiller(TOKENIZER), budget=len(text) + 1)
    outputs = [*reader.feed(llama_chunk(text, len(text)))]
    # the budget ends inside the emoji: llama-server sends it whole, past the budget
    outputs += reader.feed(llama_chunk([emoji[-1]], whole, content="🥳"))
    assert [t for o in outputs for t in o.token_ids] == [*text, emoji[0]]
    assert outputs[-1].finish_reason == "length"
    assert reader.done
    assert reader.feed({"index": 0, "stop": True, "stop_type": "limit"}) == []


@given(st.text(min_size=1, max_size=6))
def test_the_gap_filler_gives_ids_of_exactly_that_text_and_count(text: str) -> None:
    ids = TOKENIZER.encode(text, parse_special=False)
    assume(TOKENIZER.decode(ids) == text)  # (a few characters are not in its vocabulary)
    filled = GapFiller(TOKENIZER).fill(text, ids[-1], len(ids) - 1)
    assert filled is not None
    assert len(filled) == len(ids) - 1
    assert TOKENIZER.decode([*filled, ids[-1]]) == text


def test_the_gap_filler_splits_bytes_when_the_encoding_does_not_fit() -> None:
    last = TOKENIZER.encode("🥳", parse_special=False)[-1]
    # three left out, where the tokenizer spells the rest in two: a byte-level split
    filled = GapFiller(TOKENIZER).fill("🥳", last, 3)
    assert filled is not None
    assert len(filled) == 3
    assert TOKENIZER.decode([*filled, last]) == "🥳"
    assert GapFiller(TOKENIZER).fill("🥳", last, 9) is None


# -- load ------------------------------------------------------------------------------------


def test_vllms_metrics_are_summed_over_its_engines() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running x",
        'vllm:num_requests_running{engine="0"} 2.0',
        'vllm:num_requests_running{engine="1"} 1.0',
        'vllm:num_requests_waiting{engine="0"} 4.0',
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0',
        'vllm:kv_cache_usage_perc{engine="0"} 0.5',
    ])  # fmt: skip
    assert vllm_load(text, 1.0) == UpstreamLoad(3, 4, 0.5, 1.0)


def test_llama_servers_slots_and_deferred_requests() -> None:
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]
    assert llama_load(slots, "llamacpp:requests_deferred 3\n", 2.0) == UpstreamLoad(
        1, 3, None, 2.0, 0
    )
    with pytest.raises(ValueError, match="not a list"):
        llama_load({"error": "x"}, None, 0.0)


def test_a_llama_slot_before_its_first_token_is_prefilling() -> None:
    slots = [
        {"id": 0, "is_processing": True, "next_token": {"n_decoded": 0}},
        {"id": 1, "is_processing": True, "next_token": [{"n_decoded": 5}]},
        {"id": 2, "is_processing": False, "next_token": {"n_decoded": 0}},
    ]
    report = llama_load(slots, None, 1.0)
    assert (report.running, report.prefilling, report.waiting) == (2, 1, 0)
    load = report.worker_load(prefill_per_request=300)
    assert (load.prefill_tokens, load.decoding, load.waiting) == (300, 1, 1)


def test_a_report_in_the_routers_unit_estimates_the_queued_prompts() -> None:
    """Neither server says its queued prompt tokens: the requests not decoding yet, at what
    ours prefilled there lately."""
    load = UpstreamLoad(running=3, waiting=2, kv_cache_usage=0.5, at=7.0).worker_load(100.0)
    assert load == WorkerLoad(prefill_tokens=200, decoding=3, waiting=2, kv_usage=0.5, at=7.0)


# -- KV events without vLLM --------------------------------------------------------------------


@pytest.mark.vllm  # (imports vLLM: seconds)
def test_our_decoder_reads_vllms_own_encoding() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    tokens = list(range(1000, 1064))
    batch = kv_events.KVEventBatch(
        ts=1.0,
        events=[
            kv_events.BlockStored(block_hashes=[b"a", 7], parent_block_hash=None,
                                  token_ids=tokens, block_size=32, lora_id=None,
                                  medium="GPU", lora_name=None),
            kv_events.BlockRemoved(block_hashes=[7], medium="GPU"),
            kv_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=event_batch_type())
    stored, removed, cleared = decoded.events
    assert (stored.block_hashes, stored.token_ids, stored.block_size) == ([b"a", 7], tokens, 32)
    assert (removed.block_hashes, type(cleared).__name__) == ([7], "AllBlocksCleared")
    [event] = BlockTranslator(16).translate([stored])
    assert event == KvStored(tuple(block_hashes(tokens, 16)))
