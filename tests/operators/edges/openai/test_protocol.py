"""The OpenAI request models: every invalid field is an InvalidRequest naming that field."""

from __future__ import annotations

from typing import Any

import pytest

from operators.contracts.llm import OutputOptions, SamplingOptions, StopConditions
from operators.edges.openai.protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    ContentPart,
    ImageURL,
    parse_chat_request,
    parse_completion_request,
)
from pipeline import InvalidRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def user(content: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": content}])


INVALID_CHAT = [
    pytest.param({"model": "m"}, "messages", "Missing required parameter", id="no-messages"),
    pytest.param(chat(messages=[]), "messages", "at least 1", id="empty-messages"),
    pytest.param(chat(messages="hi"), "messages", "valid list", id="messages-not-list"),
    pytest.param(
        chat(messages=[{"role": "bot", "content": "x"}]), "messages.0.role", "'user'", id="role"
    ),
    pytest.param(
        chat(messages=[{"role": "user"}]), "messages.0", "needs 'content'", id="no-content"
    ),
    pytest.param(user(5), "messages.0.content", "string or an array", id="content-type"),
    pytest.param(user([{"type": "text"}]), "messages.0.content.0", "'text'", id="text-part"),
    pytest.param(
        user([{"type": "text", "text": "a"}, {"type": "audio"}]),
        "messages.0.content.1.type",
        "'image_url'",
        id="part-type",
    ),
    pytest.param(
        user([{"type": "image_url", "image_url": {}}]),
        "messages.0.content.0.image_url.url",
        "Missing",
        id="image-url",
    ),
    pytest.param(chat(max_tokens=0), "max_tokens", "greater than or equal to 1", id="max_tokens"),
    pytest.param(chat(max_tokens=1.5), "max_tokens", "integer", id="max_tokens-float"),
    pytest.param(
        chat(max_completion_tokens=0), "max_completion_tokens", ">= 1", id="max_completion"
    ),
    pytest.param(chat(n=0), "n", "greater than or equal to 1", id="n-low"),
    pytest.param(chat(n=129), "n", "less than or equal to 128", id="n-high"),
    pytest.param(chat(n=True), "n", "integer", id="n-bool"),
    pytest.param(chat(stream="yes"), "stream", "boolean", id="stream"),
    pytest.param(
        chat(stream_options={"include_usage": True}), "stream_options", "'stream'", id="opts"
    ),
    pytest.param(
        chat(stream=True, stream_options={"include_usage": "x"}),
        "stream_options.include_usage",
        "boolean",
        id="include_usage",
    ),
    pytest.param(chat(stop=""), "stop", "must not be empty", id="stop-empty"),
    pytest.param(chat(stop=["a", ""]), "stop", "must not be empty", id="stop-empty-item"),
    pytest.param(chat(stop=5), "stop", "string or an array", id="stop-type"),
    pytest.param(chat(stop=["a", 5]), "stop.1", "valid string", id="stop-item-type"),
    pytest.param(chat(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop", "at most", id="stop-too-many"),
    pytest.param(chat(temperature=-0.1), "temperature", ">= 0", id="temperature-low"),
    pytest.param(chat(temperature=2.5), "temperature", "<= 2", id="temperature-high"),
    pytest.param(chat(temperature="hot"), "temperature", "number", id="temperature-type"),
    pytest.param(chat(top_p=0), "top_p", "greater than 0", id="top_p-zero"),
    pytest.param(chat(top_p=1.1), "top_p", "<= 1", id="top_p-high"),
    pytest.param(chat(seed=1.5), "seed", "integer", id="seed"),
    pytest.param(chat(presence_penalty=3), "presence_penalty", "<= 2", id="presence"),
    pytest.param(chat(frequency_penalty=-3), "frequency_penalty", ">= -2", id="frequency"),
    pytest.param(chat(logprobs=3), "logprobs", "boolean", id="logprobs-type"),
    pytest.param(chat(top_logprobs=2), "top_logprobs", "requires 'logprobs'", id="top-alone"),
    pytest.param(chat(logprobs=True, top_logprobs=21), "top_logprobs", "<= 20", id="top-high"),
    pytest.param(chat(min_tokens=-1), "min_tokens", ">= 0", id="min_tokens"),
    pytest.param(chat(top_k=-2), "top_k", ">= -1", id="top_k-low"),
    pytest.param(chat(top_k=2.5), "top_k", "integer", id="top_k-float"),
    pytest.param(chat(min_p=1.5), "min_p", "<= 1", id="min_p-high"),
    pytest.param(chat(repetition_penalty=0), "repetition_penalty", "greater than 0", id="rep-0"),
    pytest.param(
        chat(min_tokens=5, max_tokens=3), "min_tokens", "exceeds 'max_tokens'", id="min>max"
    ),
    pytest.param(
        chat(min_tokens=5, max_tokens=9, max_completion_tokens=3),
        "min_tokens",
        "exceeds 'max_completion_tokens'",
        id="min>max_completion",
    ),
    pytest.param(chat(stop_token_ids=[1, -1]), "stop_token_ids.1", ">= 0", id="stop-ids"),
    pytest.param(chat(ignore_eos="no"), "ignore_eos", "boolean", id="ignore_eos"),
    pytest.param(chat(model=5), "model", "string", id="model"),
]


def _equivalent(expected: str, message: str) -> bool:
    # pydantic says "greater than or equal to"; the table may use the short form.
    long = expected.replace(">= ", "greater than or equal to ").replace(
        "<= ", "less than or equal to "
    )
    return expected in message or long in message


@pytest.mark.parametrize(("body", "param", "message"), INVALID_CHAT)
def test_invalid_chat_field_names_the_field(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(body)
    assert caught.value.param == param
    assert _equivalent(message, caught.value.message), caught.value.message
    assert param in caught.value.message


INVALID_COMPLETION = [
    pytest.param({"model": "m"}, "prompt", "Missing required parameter", id="no-prompt"),
    pytest.param(completion(prompt=5), "prompt", "a string, an array", id="prompt-type"),
    pytest.param(completion(prompt=[]), "prompt", "at least 1", id="prompt-empty-list"),
    pytest.param(completion(prompt=[1, "a"]), "prompt.1", "integer", id="prompt-mixed"),
    pytest.param(completion(prompt=[1, -2]), "prompt.1", ">= 0", id="prompt-negative-id"),
    pytest.param(completion(prompt=[1, True]), "prompt.1", "integer", id="prompt-bool-id"),
    pytest.param(completion(prompt=["a", 1]), "prompt.1", "string", id="prompt-strings"),
    pytest.param(completion(prompt=[[1], []]), "prompt.1", "at least 1", id="prompt-empty-ids"),
    pytest.param(completion(prompt=[[1], [2, "x"]]), "prompt.1.1", "integer", id="prompt-batch"),
    pytest.param(completion(logprobs=21), "logprobs", "<= 20", id="logprobs-high"),
    pytest.param(completion(logprobs=-1), "logprobs", ">= 0", id="logprobs-low"),
    pytest.param(completion(echo=True, logprobs=1), "echo", "not supported", id="echo+logprobs"),
    pytest.param(completion(suffix="x"), "suffix", "not supported", id="suffix"),
    pytest.param(completion(max_tokens=0), "max_tokens", ">= 1", id="max_tokens"),
]


@pytest.mark.parametrize(("body", "param", "message"), INVALID_COMPLETION)
def test_invalid_completion_field_names_the_field(
    body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_completion_request(body)
    assert caught.value.param == param
    assert _equivalent(message, caught.value.message), caught.value.message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"model": ', "could not parse the request body as JSON"),
        (b"", "could not parse the request body as JSON"),
        (b'{"model": "\xff"}', "not valid UTF-8"),
        (b"[1, 2]", "must be a JSON object"),
        ("null", "must be a JSON object"),
    ],
)
def test_malformed_body_is_invalid_request(body: bytes | str, message: str) -> None:
    for parse in (parse_chat_request, parse_completion_request):
        with pytest.raises(InvalidRequest, match=message) as caught:
            parse(body)
        assert caught.value.param is None


def test_several_errors_report_the_first_and_count_the_rest() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(chat(temperature=9, top_p=9))
    assert caught.value.param == "temperature"
    assert "(and 1 more error)" in caught.value.message


def test_bytes_str_and_dict_bodies_parse_alike() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}'
    assert parse_chat_request(body) == parse_chat_request(body.decode())
    assert parse_chat_request(body) == parse_chat_request(chat(n=2))


def test_unknown_fields_are_ignored_and_null_means_default() -> None:
    request = parse_chat_request(
        chat(
            logit_bias={},
            tools=[],
            tool_choice="none",
            response_format={"type": "text"},
            user="u",
            metadata={"k": "v"},
            frobnicate=True,
            n=None,
            stream=None,
            stop=None,
            skip_special_tokens=None,
        )
    )
    assert request.n == 1
    assert request.stream is False
    assert request.stop is None
    assert request.skip_special_tokens is True
    assert not hasattr(request, "frobnicate")


def test_defaults() -> None:
    request = parse_chat_request(chat())
    assert request.model == "m"
    assert (request.n, request.stream, request.stream_options) == (1, False, None)
    assert request.requested_max_tokens == (None, "max_tokens")
    assert request.logprobs_count is None
    assert request.include_usage is False
    assert request.stop_conditions(max_tokens=None, eos_token_ids=(2,)) == StopConditions(
        eos_token_ids=(2,)
    )
    assert request.sampling_options() == SamplingOptions()
    assert request.output_options() == OutputOptions(logprobs=None, skip_special_tokens=True)
    assert parse_completion_request({"prompt": "x"}).model is None


def test_content_parts_parse_including_images() -> None:
    request = parse_chat_request(
        user(
            [
                {"type": "text", "text": "what is this?"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,AA", "detail": "low"},
                },
            ]
        )
    )
    content = request.messages[0].content
    assert content == [
        ContentPart(type="text", text="what is this?"),
        ContentPart(
            type="image_url", image_url=ImageURL(url="data:image/png;base64,AA", detail="low")
        ),
    ]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_every_role_parses(role: str) -> None:
    message: dict[str, Any] = {"role": role, "content": "x"}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    request = parse_chat_request(chat(messages=[message]))
    assert request.messages[0].role == role


def test_assistant_content_may_be_null() -> None:
    request = parse_chat_request(
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]},
            ]
        )
    )
    assert request.messages[1].content is None
    assert request.messages[1].tool_calls == [{"id": "call_1"}]


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt: Any, prompts: Any) -> None:
    request = parse_completion_request(completion(prompt=prompt))
    assert request.prompt == prompt
    assert request.prompts == prompts


def test_generation_fields_convert_to_hot_path_records() -> None:
    request = parse_chat_request(
        chat(
            max_tokens=50,
            max_completion_tokens=20,
            min_tokens=2,
            stop="END",
            stop_token_ids=[7],
            ignore_eos=True,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            temperature=0.5,
            top_p=0.9,
            seed=42,
            presence_penalty=0.1,
            frequency_penalty=-0.2,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert request.requested_max_tokens == (20, "max_completion_tokens")
    assert request.stop == ["END"]
    assert request.include_usage is True
    assert request.stop_conditions(max_tokens=20, eos_token_ids=(0, 2)) == StopConditions(
        max_tokens=20,
        min_tokens=2,
        stop=("END",),
        stop_token_ids=(7,),
        eos_token_ids=(0, 2),
        include_stop_str_in_output=True,
        ignore_eos=True,
    )
    assert request.sampling_options() == SamplingOptions(
        temperature=0.5,
        top_p=0.9,
        seed=42,
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
    )
    assert request.output_options() == OutputOptions(logprobs=3, skip_special_tokens=False)


@pytest.mark.parametrize(
    ("fields", "count"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
    ],
)
def test_chat_logprobs_count(fields: dict[str, Any], count: int | None) -> None:
    assert parse_chat_request(chat(**fields)).logprobs_count == count


@pytest.mark.parametrize(("logprobs", "count"), [(None, None), (0, 0), (5, 5), (20, 20)])
def test_completion_logprobs_count(logprobs: int | None, count: int | None) -> None:
    assert parse_completion_request(completion(logprobs=logprobs)).logprobs_count == count


def test_include_usage_needs_stream_and_the_option() -> None:
    assert not parse_chat_request(chat(stream=True)).include_usage
    assert not parse_chat_request(
        chat(stream=True, stream_options={"include_usage": False})
    ).include_usage
    assert parse_completion_request(
        completion(stream=True, stream_options={"include_usage": True})
    ).include_usage


def test_models_can_be_built_in_python() -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])  # type: ignore[list-item]
    assert request.messages[0].content == "x"
    assert CompletionRequest(prompt=[1, 2]).prompts == [[1, 2]]


#: honoured by the chat endpoint (tests/operators/edges/openai/test_tool_requests.py), refused by
#: the completions endpoint
CHAT_ONLY = [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
]


@pytest.mark.parametrize(("field", "value"), CHAT_ONLY)
def test_completions_refuse_tools_and_response_format_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_completion_request({"model": "m", "prompt": "hi", field: value})
    assert caught.value.param == field
    assert "not supported" in caught.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("logit_bias", {"1": 5}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {"search_context_size": "low"}),
        ("best_of", 3),
        ("verbosity", "low"),
        ("service_tier", "priority"),
        ("moderation", {"model": "omni-moderation-latest"}),
    ],
)
@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
def test_fields_the_server_cannot_honour_are_refused_by_name(
    field: str, value: Any, parse: Any
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    body[field] = value
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    assert caught.value.param == field
    assert "not supported" in caught.value.message or "only" in caught.value.message
