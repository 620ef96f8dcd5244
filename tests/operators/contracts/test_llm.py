"""The hot-path records: the per-token ones may be built positionally, so their field
order is API (the Backend and the echo engine rely on it)."""

from __future__ import annotations

import dataclasses

from operators.contracts.llm import BackendOutput, EngineOutput


def test_engine_output_field_order() -> None:
    assert [f.name for f in dataclasses.fields(EngineOutput)] == [
        "token_ids",
        "logprobs",
        "top_logprobs",
        "finish_reason",
        "index",
        "text",
        "encoder_result",
        "prefill_result",
        "cached_tokens",
    ]
    assert EngineOutput([7], None, None, "stop", 1) == EngineOutput(
        token_ids=[7], finish_reason="stop", index=1
    )


def test_backend_output_field_order() -> None:
    assert [f.name for f in dataclasses.fields(BackendOutput)] == [
        "token_ids",
        "tokens",
        "text",
        "logprobs",
        "top_logprobs",
        "finish_reason",
        "stop_reason",
        "index",
        "delivered_tokens",
        "reasoning",
        "tool_calls",
    ]
