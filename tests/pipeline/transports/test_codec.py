"""Payload codecs: what round-trips, what is refused, and how."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("msgpack", reason="the codec tests need the nats extra (msgpack)")

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from operators.contracts.llm import (
    BackendOutput,
    EngineOutput,
    MultimodalItem,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from operators.contracts.transport import LLM_TYPES
from pipeline.transports.codec import Codec, DataclassCodec, MsgpackCodec

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@pytest.mark.parametrize("codec", [MsgpackCodec(), DataclassCodec(LLM_TYPES)], ids=repr)
@given(value=json_like)
def test_json_like_values_round_trip(codec: Codec, value: Any) -> None:
    assert codec.decode(codec.encode(value)) == value


def test_the_llm_types_round_trip_nested_with_their_tuples() -> None:
    codec = DataclassCodec(LLM_TYPES)
    request = PreprocessedRequest(
        token_ids=[1, 2, 3],
        stop=StopConditions(max_tokens=8, stop=("\n", "END"), eos_token_ids=(2,)),
        sampling=SamplingOptions(temperature=0.5),
        multimodal=(MultimodalItem(kind="image", data=b"\x89PNG", mime_type="image/png"),),
        prefill_result={"kind": "kv", "blocks": [1, 2]},
    )
    frame = [3, 1, request]
    back = codec.decode(codec.encode(frame))
    assert back == frame
    assert isinstance(back[2].stop.stop, tuple)
    assert isinstance(back[2].multimodal[0], MultimodalItem)
    output = BackendOutput(
        token_ids=[7], tokens=["a"], text="a", top_logprobs=[[(7, -0.1), (8, -1.5)]]
    )
    assert codec.decode(codec.encode(output)) == output


def test_a_plain_dict_with_a_tag_like_key_is_left_alone() -> None:
    codec = DataclassCodec(LLM_TYPES)
    value = {"None": "EngineOutput", "()": [1]}
    assert codec.decode(codec.encode(value)) == value


def test_msgpack_codec_sends_tuples_as_lists_and_refuses_objects() -> None:
    codec = MsgpackCodec()
    assert codec.decode(codec.encode((1, (2, 3)))) == [1, [2, 3]]
    with pytest.raises(TypeError):
        codec.encode(EngineOutput(token_ids=[1]))


class Color(enum.IntEnum):
    RED = 1


@dataclass(slots=True)
class Derived:
    base: int
    double: int = field(init=False)

    def __post_init__(self) -> None:
        self.double = 2 * self.base


def test_subclasses_of_builtins_travel_as_the_plain_value_and_init_false_is_rebuilt() -> None:
    codec = DataclassCodec([Derived])
    assert codec.decode(codec.encode([Color.RED])) == [1]
    assert codec.decode(codec.encode(Derived(4))) == Derived(4)


def test_what_dataclass_codec_refuses_names_the_fix() -> None:
    codec = DataclassCodec([EngineOutput])
    with pytest.raises(TypeError, match=r"StopConditions is not registered .*types=\["):
        codec.encode(StopConditions())
    with pytest.raises(TypeError, match="cannot encode object"):
        codec.encode(object())
    with pytest.raises(ValueError, match="unknown type tag 'StopConditions'"):
        codec.decode(DataclassCodec([StopConditions]).encode(StopConditions()))
    with pytest.raises(ValueError, match="cannot decode"):
        codec.decode(b"\xc1")


def test_registration_is_checked() -> None:
    with pytest.raises(TypeError, match="dataclass types only"):
        DataclassCodec([int])
    with pytest.raises(ValueError, match="tagged 'EngineOutput'"):
        DataclassCodec([EngineOutput, EngineOutput])
    codec = DataclassCodec({"eo": EngineOutput})
    assert codec.types == {"eo": EngineOutput}
    assert codec.decode(codec.encode(EngineOutput(token_ids=[1]))) == EngineOutput(token_ids=[1])


def test_fields_holding_their_default_are_left_out() -> None:
    codec = DataclassCodec(LLM_TYPES)
    output = EngineOutput(token_ids=[7], finish_reason="stop")
    sent = msgpack.unpackb(codec.encode(output), strict_map_key=False)
    assert sent == {None: "EngineOutput", "token_ids": [7], "finish_reason": "stop"}
    assert codec.decode(codec.encode(output)) == output


@given(
    output=st.builds(
        EngineOutput,
        token_ids=st.lists(st.integers(0, 2**31)),
        logprobs=st.none() | st.lists(st.floats(allow_nan=False)),
        finish_reason=st.sampled_from([None, "stop", "length"]),
        index=st.integers(0, 3),
        text=st.none() | st.text(),
        prefill_result=st.none() | st.dictionaries(st.text(), st.integers(-(2**63), 2**63 - 1)),
    )
)
def test_outputs_round_trip_whichever_fields_hold_defaults(output: EngineOutput) -> None:
    codec = DataclassCodec(LLM_TYPES)
    assert codec.decode(codec.encode(output)) == output
