"""The OpenAI preprocessor: templates and tokens forward, typed OpenAI events backward.

The backward edge is checked against BackendOutputs written by hand, both as the event
stream the preprocessor yields (one ResponseHead first, one Usage last with the right
counts, chat choices opening with a ChoiceStart, one finish per choice, interleaved
choices, logprobs only for delivered tokens) and as what a client sees once the events are
rendered (:func:`stream_chunks`, with and without ``include_usage``; the non-streamed
:func:`aggregate_chat` / :func:`aggregate_completion`); against the real Backend and echo
engine; and as a Hypothesis property: for any split of any outputs, the non-streamed
response equals the concatenation of the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators.backend import Backend
from operators.contracts.llm import (
    BackendOutput,
    EngineOutput,
    FinishReason,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from operators.edges.openai import (
    ChatTemplate,
    ChoiceDelta,
    ChoiceStart,
    OpenAIEvent,
    OpenAIPreprocessor,
    ResponseHead,
    Usage,
    aggregate_chat,
    aggregate_completion,
    parse_chat_request,
    parse_completion_request,
    stream_chunks,
)
from operators.edges.openai.protocol import ChatCompletionRequest, CompletionRequest
from operators.engines.echo import EchoEngine
from operators.text.tokenizer import Tokenizer
from pipeline import EngineError, InvalidRequest, link, open_stream
from pipeline.testing import ScriptedEngine, check_operator, collect, make_context

TOKENIZER = Tokenizer.default()
SYSTEM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

Chunk = dict[str, Any]
ChoiceEvent = ChoiceStart | ChoiceDelta


def preprocessor(**options: Any) -> OpenAIPreprocessor:
    return OpenAIPreprocessor(TOKENIZER, model_name="smollm2", **options)


def chat(**fields: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    return parse_chat_request({**body, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return parse_completion_request({"model": "m", "prompt": "Hello", **fields})


def out(
    text: str,
    *,
    tokens: Sequence[str] | None = None,
    ids: Sequence[int] | None = None,
    index: int = 0,
    finish: FinishReason | None = None,
    delivered: int,
    logprobs: bool = False,
) -> BackendOutput:
    """A BackendOutput; by default one token whose text is ``text``."""
    tokens = [text] if tokens is None else list(tokens)
    ids = [100 + i for i in range(len(tokens))] if ids is None else list(ids)
    return BackendOutput(
        token_ids=ids,
        tokens=tokens,
        text=text,
        logprobs=[-0.5] * len(ids) if logprobs else None,
        top_logprobs=[[(token_id, -0.5), (token_id + 1, -1.5)] for token_id in ids]
        if logprobs
        else None,
        finish_reason=finish,
        index=index,
        delivered_tokens=delivered,
    )


async def run(
    request: ChatCompletionRequest | CompletionRequest,
    outputs: Sequence[BackendOutput],
    **options: Any,
) -> list[OpenAIEvent]:
    """The events the preprocessor yields for ``request`` when downstream plays ``outputs``."""
    engine = ScriptedEngine(outputs)
    return await collect(link(preprocessor(**options), engine), make_context(request))


def tid(text: str) -> int:
    """The id of a text that is one token."""
    [token_id] = TOKENIZER.encode(text)
    return token_id


def prompt_tokens(request: ChatCompletionRequest | CompletionRequest) -> int:
    """The prompt tokens of ``request``, over all its prompts."""
    return sum(leg.prompt_tokens for leg in preprocessor().preprocess(request))


def check_events(events: list[OpenAIEvent]) -> tuple[ResponseHead, list[ChoiceEvent], Usage]:
    """The rules the events of every complete response keep: ``(head, choice events, usage)``.

    Exactly one ResponseHead, first; exactly one Usage, last; only choice events between
    them; a chat choice opens with its only ChoiceStart (completions have none); every
    choice finishes exactly once, on its last event.
    """
    assert len(events) >= 2
    head, *middle, usage = events
    assert isinstance(head, ResponseHead)
    assert isinstance(usage, Usage)
    body = [event for event in middle if isinstance(event, ChoiceStart | ChoiceDelta)]
    assert body == middle  # no second head, no second usage
    chat_response = head.object == "chat.completion.chunk"
    for index in {event.index for event in body}:
        mine = choice_events(body, index)
        starts = [event for event in mine if isinstance(event, ChoiceStart)]
        if chat_response:
            assert len(starts) == 1
            assert isinstance(mine[0], ChoiceStart)
        else:
            assert starts == []
        finishes = [
            event.finish_reason
            for event in mine
            if isinstance(event, ChoiceDelta) and event.finish_reason is not None
        ]
        assert len(finishes) == 1
        last = mine[-1]
        assert isinstance(last, ChoiceDelta)
        assert last.finish_reason is not None
    return head, body, usage


def choice_events(events: Sequence[OpenAIEvent], index: int) -> list[ChoiceEvent]:
    return [e for e in events if isinstance(e, ChoiceStart | ChoiceDelta) and e.index == index]


def choices_of(chunks: list[Chunk], index: int) -> list[Chunk]:
    return [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]


# ------------------------------------------------------------------ chat template


def test_multi_turn_chat_renders_the_smollm2_format() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "How are you?"},
        ]
    )
    assert preprocessor().render_chat(request) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_adds_the_default_system_prompt_and_maps_developer_to_system() -> None:
    pre = preprocessor()
    assert pre.render_chat(chat()) == (
        f"<|im_start|>system\n{SYSTEM_DEFAULT}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    developer = chat(
        messages=[{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"}]
    )
    assert pre.render_chat(developer).startswith("<|im_start|>system\nRules.<|im_end|>\n")


def test_text_parts_are_joined_by_newlines() -> None:
    request = chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            }
        ]
    )
    assert "<|im_start|>user\none\ntwo<|im_end|>" in preprocessor().render_chat(request)


def test_template_errors_are_invalid_requests() -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] | tojson }}{% endfor %}"
    )
    pre = preprocessor(chat_template=template)
    assert pre.render_chat(chat(messages=[{"role": "user", "content": "é"}])) == '"é"'
    with pytest.raises(InvalidRequest, match="System role not supported") as caught:
        pre.render_chat(chat(messages=[{"role": "system", "content": "x"}]))
    assert caught.value.param == "messages"


def test_hf_template_helpers_render() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}"
        "{{ strftime_now('%Y') | length }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    assert template.render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    ) == ("<s>a</s>4")


def test_a_broken_template_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        preprocessor(chat_template="{% for %}")


def test_the_template_is_sandboxed() -> None:
    pre = preprocessor(chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequest):
        pre.render_chat(chat())


def test_no_template_means_no_chat() -> None:
    class NoTemplate:
        eos_token_ids = frozenset({0})
        chat_template = None

        def encode(
            self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
        ) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
            return "".join(map(chr, ids))

        def id_to_token(self, token_id: int) -> str | None:
            return chr(token_id)

    pre = OpenAIPreprocessor(NoTemplate(), model_name="x")
    with pytest.raises(InvalidRequest, match="no chat template"):
        pre.preprocess(chat())
    assert pre.preprocess(completion(prompt="ab"))[0].token_ids == [97, 98]


# ---------------------------------------------------------------------- forward edge


def test_chat_request_becomes_a_preprocessed_request() -> None:
    request = chat(
        max_completion_tokens=7,
        stop=["\n\n"],
        temperature=0.3,
        seed=1,
        logprobs=True,
        n=2,
        skip_special_tokens=False,
    )
    pre = preprocessor()
    [preprocessed] = pre.preprocess(request)
    text = pre.render_chat(request)
    assert preprocessed == PreprocessedRequest(
        token_ids=TOKENIZER.encode(text),
        stop=StopConditions(
            max_tokens=7, stop=("\n\n",), eos_token_ids=tuple(sorted(TOKENIZER.eos_token_ids))
        ),
        sampling=SamplingOptions(temperature=0.3, seed=1),
        output=OutputOptions(logprobs=0, skip_special_tokens=False),
        model="m",
        n=2,
    )
    assert preprocessed.token_ids[0] == TOKENIZER.bos_token_id  # <|im_start|> is one id


def test_model_name_is_the_default_model() -> None:
    [preprocessed] = preprocessor().preprocess(parse_completion_request({"prompt": "x"}))
    assert preprocessed.model == "smollm2"


def test_completion_prompt_parses_control_tokens() -> None:
    # The client owns a completions prompt whole, so it may write its own chat format.
    [preprocessed] = preprocessor().preprocess(completion(prompt="<|im_start|>user\nHi"))
    assert preprocessed.token_ids == TOKENIZER.encode("<|im_start|>user\nHi")
    assert preprocessed.token_ids[0] == 1


def test_token_id_prompts_pass_through_and_are_checked() -> None:
    [preprocessed] = preprocessor().preprocess(completion(prompt=[5, 6, 7]))
    assert preprocessed.token_ids == [5, 6, 7]
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as caught:
        preprocessor().preprocess(completion(prompt=[5, TOKENIZER.vocab_size]))
    assert caught.value.param == "prompt.1"
    with pytest.raises(InvalidRequest) as caught:
        preprocessor().preprocess(completion(prompt=[[5], [6, 10**9]]))
    assert caught.value.param == "prompt.1.1"


@pytest.mark.parametrize("prompt", ["", ["a", ""]])
def test_empty_prompt_is_rejected(prompt: Any) -> None:
    with pytest.raises(InvalidRequest, match="empty") as caught:
        preprocessor().preprocess(completion(prompt=prompt))
    assert caught.value.param == ("prompt" if prompt == "" else "prompt.1")


def test_context_length_is_enforced() -> None:
    prompt = [5] * 10
    pre = preprocessor(max_model_len=12)
    with pytest.raises(InvalidRequest, match="maximum context length is 12") as caught:
        pre.preprocess(completion(prompt=prompt, max_tokens=3))
    assert caught.value.param == "max_tokens"
    assert "13 tokens (10 in the prompt, 3 for the completion)" in caught.value.message
    with pytest.raises(InvalidRequest) as caught:
        preprocessor(max_model_len=100).preprocess(chat(max_tokens=1, max_completion_tokens=99))
    assert caught.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequest, match="no room") as caught:
        preprocessor(max_model_len=10).preprocess(completion(prompt=prompt))
    assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="no room") as caught:
        preprocessor(max_model_len=10).preprocess(chat())
    assert caught.value.param == "messages"
    [fits] = pre.preprocess(completion(prompt=prompt, max_tokens=2))
    assert fits.stop.max_tokens == 2


@pytest.mark.parametrize(
    ("max_model_len", "default_max_tokens", "expected"),
    [(None, None, None), (None, 16, 16), (30, None, 20), (30, 16, 16), (30, 64, 20)],
)
def test_default_max_tokens(
    max_model_len: int | None, default_max_tokens: int | None, expected: int | None
) -> None:
    pre = preprocessor(max_model_len=max_model_len, default_max_tokens=default_max_tokens)
    [preprocessed] = pre.preprocess(completion(prompt=[5] * 10))
    assert preprocessed.stop.max_tokens == expected


# -------------------------------------------------------------------- backward edge


async def test_chat_stream_shape() -> None:
    request = chat(stream=True)
    events = await run(
        request,
        [
            out("Hel", delivered=1),
            out("lo", delivered=2),
            out("", tokens=[""], ids=[2], delivered=2, finish="stop"),
        ],
    )
    head, body, usage = check_events(events)
    assert head.id.startswith("chatcmpl-")
    assert head.object == "chat.completion.chunk"
    assert head.model == "m"
    assert isinstance(head.created, int)
    assert body == [
        ChoiceStart(0),
        ChoiceDelta(0, "Hel"),
        ChoiceDelta(0, "lo"),
        ChoiceDelta(0, "", None, "stop"),
    ]
    assert usage == Usage(
        prompt_tokens=prompt_tokens(request), completion_tokens=3, finish_reasons=("stop",)
    )
    chunks = stream_chunks(events, include_usage=request.include_usage)
    assert {chunk["id"] for chunk in chunks} == {head.id}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "m"
        assert chunk["created"] == head.created
        assert "usage" not in chunk
        assert "stop_reason" not in chunk["choices"][0]
    assert [c["delta"] for c in choices_of(chunks, 0)] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert [c["finish_reason"] for c in choices_of(chunks, 0)] == [None, None, None, "stop"]
    assert all(c["logprobs"] is None for c in choices_of(chunks, 0))


async def test_finish_may_ride_with_the_last_text_and_silent_outputs_are_skipped() -> None:
    events = await run(
        chat(stream=True),
        [
            out("", tokens=[""], delivered=0),  # first half of a character: nothing to say
            out("é", tokens=["é"], delivered=2),
            out("!", delivered=3, finish="length"),
        ],
    )
    _, body, usage = check_events(events)
    assert body == [ChoiceStart(0), ChoiceDelta(0, "é"), ChoiceDelta(0, "!", None, "length")]
    assert usage.completion_tokens == 3  # the silent output's token is counted
    chunks = stream_chunks(events, include_usage=False)
    assert [(c["delta"], c["finish_reason"]) for c in choices_of(chunks, 0)] == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "é"}, None),
        ({"content": "!"}, "length"),
    ]


async def test_n2_interleaved_choices_each_open_and_finish_once() -> None:
    outputs = [
        out("a", index=1, delivered=1),
        out("x", index=0, delivered=1),
        out("b", index=1, delivered=2),
        out("y", index=0, delivered=2, finish="length"),
        out("c", index=1, delivered=3, finish="stop"),
    ]
    events = await run(chat(n=2, stream=True), outputs)
    _, body, usage = check_events(events)
    assert usage.completion_tokens == 5
    chunks = stream_chunks(events, include_usage=False)
    for index, text, finish in [(0, "xy", "length"), (1, "abc", "stop")]:
        mine_events = choice_events(body, index)
        assert mine_events[0] == ChoiceStart(index)
        assert "".join(e.text for e in mine_events if isinstance(e, ChoiceDelta)) == text
        mine = choices_of(chunks, index)
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == text
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [finish]
        assert mine[-1]["finish_reason"] == finish
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)


async def test_outputs_after_a_finish_are_dropped_but_counted() -> None:
    events = await run(
        chat(),
        [out("a", delivered=1, finish="stop"), out("b", delivered=2, finish="stop")],
    )
    _, body, usage = check_events(events)
    assert body == [ChoiceStart(0), ChoiceDelta(0, "a", None, "stop")]
    assert usage.completion_tokens == 2
    chunks = stream_chunks(events, include_usage=False)
    assert [c["finish_reason"] for c in choices_of(chunks, 0)] == [None, "stop"]
    whole = aggregate_chat(events)
    assert whole["choices"][0]["message"]["content"] == "a"
    assert whole["usage"]["completion_tokens"] == 2


async def test_usage_once_at_the_end_with_include_usage() -> None:
    outputs = [
        out("a", index=0, delivered=1),
        out("b", index=1, delivered=1),
        # a hidden stop: 2 tokens generated, the second swallowed (never delivered)
        out("c", tokens=["c", "STOP"], ids=[7, 8], index=0, delivered=2, finish="stop"),
        out("d", index=1, delivered=2, finish="stop"),
    ]
    request = chat(n=2, stream=True, stream_options={"include_usage": True})
    assert request.include_usage
    events = await run(request, outputs)
    _, _, usage = check_events(events)
    assert [event for event in events if isinstance(event, Usage)] == [events[-1]]
    count = prompt_tokens(request)
    expected = {"prompt_tokens": count, "completion_tokens": 5, "total_tokens": count + 5}
    assert usage.as_dict() == expected
    chunks = stream_chunks(events, include_usage=True)
    usage_chunks = [chunk for chunk in chunks if chunk["usage"] is not None]
    assert usage_chunks == [chunks[-1]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == expected
    assert all("usage" in chunk for chunk in chunks)  # None on every other chunk, as OpenAI
    # without include_usage the same events show the same chunks, minus all usage
    plain = stream_chunks(events, include_usage=False)
    assert plain == [
        {key: value for key, value in chunk.items() if key != "usage"} for chunk in chunks[:-1]
    ]
    assert aggregate_chat(events)["usage"] == expected


async def test_usage_always_ends_the_events_and_shows_only_when_asked_for_or_not_streaming() -> (
    None
):
    outputs = [out("a", delivered=1, finish="stop")]
    plain_request = chat(stream=True)
    asked_request = chat(stream=True, stream_options={"include_usage": True})
    whole_request = chat(stream=False)
    count = prompt_tokens(plain_request)
    bodies = []
    responses = []
    for request in (plain_request, asked_request, whole_request):
        events = await run(request, outputs)
        _, body, usage = check_events(events)
        assert usage == Usage(prompt_tokens=count, completion_tokens=1, finish_reasons=("stop",))
        bodies.append(body)
        responses.append(events)
    # the event stream is the same however the response will be shown
    assert bodies[0] == bodies[1] == bodies[2]
    plain, asked, whole = responses
    streamed = stream_chunks(plain, include_usage=plain_request.include_usage)
    assert all(chunk["choices"] for chunk in streamed)
    assert all("usage" not in chunk for chunk in streamed)
    shown = stream_chunks(asked, include_usage=asked_request.include_usage)
    assert shown[-1]["choices"] == []
    assert shown[-1]["usage"]["completion_tokens"] == 1
    assert all(chunk["choices"] and chunk["usage"] is None for chunk in shown[:-1])
    assert aggregate_chat(whole)["usage"] == {
        "prompt_tokens": count,
        "completion_tokens": 1,
        "total_tokens": count + 1,
    }


async def test_prompt_tokens_are_the_users_prompt() -> None:
    events = await run(completion(prompt=[5, 6, 7]), [out("a", delivered=1, finish="stop")])
    _, _, usage = check_events(events)
    assert usage == Usage(prompt_tokens=3, completion_tokens=1, finish_reasons=("stop",))
    assert aggregate_completion(events)["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
    }


async def test_chat_logprobs_only_for_delivered_tokens() -> None:
    outputs = [
        out("A", tokens=["A"], ids=[tid("A")], delivered=1, logprobs=True),
        # " S" may start the hidden stop " STOP": withheld, not delivered
        out("", tokens=[" S"], ids=[tid(" S")], delivered=1, logprobs=True),
        # it was not a stop after all: released, both delivered now
        out(" Sx", tokens=["x"], ids=[tid("x")], delivered=3, logprobs=True),
        # " STOP" swallowed by the hidden stop: never delivered
        out(
            "",
            tokens=[" ST", "OP"],
            ids=[tid(" ST"), tid("OP")],
            delivered=3,
            logprobs=True,
            finish="stop",
        ),
    ]
    events = await run(chat(logprobs=True, top_logprobs=1), outputs)
    _, body, usage = check_events(events)
    assert usage.completion_tokens == 5
    start, *rest = body
    assert start == ChoiceStart(0)
    deltas = [event for event in rest if isinstance(event, ChoiceDelta)]
    assert deltas == rest
    assert [(d.text, d.finish_reason) for d in deltas] == [("A", None), (" Sx", None), ("", "stop")]
    entries = [e for d in deltas if d.logprobs for e in d.logprobs["content"]]
    assert [e["token"] for e in entries] == ["A", " S", "x"]
    released = deltas[1].logprobs
    assert released is not None
    # the withheld " S" arrives with the delta that releases its text
    assert [e["token"] for e in released["content"]] == [" S", "x"]
    assert deltas[2].logprobs is None  # nothing new was delivered with the finish
    first = entries[0]
    assert first["logprob"] == -0.5
    assert first["bytes"] == list(b"A")
    assert first["top_logprobs"] == [{"token": "A", "logprob": -0.5, "bytes": list(b"A")}]
    assert released["refusal"] is None
    mine = choices_of(stream_chunks(events, include_usage=False), 0)
    assert [c["delta"].get("content") for c in mine] == ["", "A", " Sx", None]
    assert [c["logprobs"] for c in mine] == [None, *(d.logprobs for d in deltas)]
    assert [e["token"] for e in mine[2]["logprobs"]["content"]] == [" S", "x"]
    assert mine[2]["logprobs"]["refusal"] is None
    whole = aggregate_chat(events)
    assert [e["token"] for e in whole["choices"][0]["logprobs"]["content"]] == ["A", " S", "x"]


async def test_logprob_bytes_are_the_tokens_real_bytes() -> None:
    ids = TOKENIZER.encode(" 😀")  # one character split over several byte-level tokens
    assert len(ids) > 1
    tokens = [""] * (len(ids) - 1) + [" 😀"]
    outputs = [
        BackendOutput(
            token_ids=ids,
            tokens=tokens,
            text=" 😀",
            logprobs=[-1.0] * len(ids),
            top_logprobs=[[(i, -1.0)] for i in ids],
            delivered_tokens=len(ids),
            finish_reason="stop",
        )
    ]
    events = await run(chat(logprobs=True, top_logprobs=1), outputs)
    _, body, _ = check_events(events)
    delta = body[1]
    assert isinstance(delta, ChoiceDelta)
    assert delta.logprobs is not None
    entries = choices_of(stream_chunks(events, include_usage=False), 0)[1]["logprobs"]["content"]
    assert entries == delta.logprobs["content"]
    assert [e["token"] for e in entries] == tokens
    assert b"".join(bytes(e["bytes"]) for e in entries) == " 😀".encode()
    assert all(e["bytes"] for e in entries)  # each token reports its own bytes
    assert [e["top_logprobs"][0]["bytes"] for e in entries] == [e["bytes"] for e in entries]


async def test_completion_chunks_and_logprobs() -> None:
    outputs = [
        out("Hi", tokens=["Hi"], ids=[tid("Hi")], delivered=1, logprobs=True),
        out("", tokens=[" th"], ids=[tid(" th")], delivered=1, logprobs=True),
        out(
            " there", tokens=["ere"], ids=[tid("ere")], delivered=3, logprobs=True, finish="length"
        ),
    ]
    request = completion(logprobs=1, stream=True)
    events = await run(request, outputs)
    head, body, usage = check_events(events)
    assert head.id.startswith("cmpl-")
    assert head.object == "text_completion"
    assert [(e.text, e.finish_reason) for e in body if isinstance(e, ChoiceDelta)] == [
        ("Hi", None),
        (" there", "length"),
    ]
    assert usage.completion_tokens == 3
    chunks = stream_chunks(events, include_usage=request.include_usage)
    assert {chunk["id"] for chunk in chunks} == {head.id}
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert all("usage" not in chunk for chunk in chunks)
    mine = choices_of(chunks, 0)
    assert [c["text"] for c in mine] == ["Hi", " there"]
    assert mine[-1]["finish_reason"] == "length"
    first, second = (c["logprobs"] for c in mine)
    assert first == {
        "tokens": ["Hi"],
        "token_logprobs": [-0.5],
        # the best alternative (k=1) is the sampled token itself here
        "top_logprobs": [{"Hi": -0.5}],
        "text_offset": [0],
    }
    assert second["tokens"] == [" th", "ere"]
    assert second["text_offset"] == [2, 5]
    whole = aggregate_completion(events)
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 2, 5]


async def test_completion_echo_prefixes_the_prompt() -> None:
    events = await run(
        completion(prompt="Say", echo=True, n=2),
        [
            out(" hi", index=0, delivered=1, finish="stop"),
            out("", index=1, delivered=0, finish="stop"),
        ],
    )
    check_events(events)
    whole = aggregate_completion(events)
    assert [c["text"] for c in whole["choices"]] == ["Say hi", "Say"]
    ids = await run(
        completion(prompt=TOKENIZER.encode("Say so"), echo=True),
        [out("!", delivered=1, finish="stop")],
    )
    check_events(ids)
    assert aggregate_completion(ids)["choices"][0]["text"] == "Say so!"


async def test_completion_batch_numbers_choices_per_prompt() -> None:
    engine = ScriptedEngine(
        lambda ctx: [
            out(f"<{ctx.data.token_ids[0]}:{i}>", index=i, delivered=1, finish="stop")
            for i in range(ctx.data.n)
        ]
    )
    request = completion(prompt=[[5], [6, 6]], n=2)
    events = await collect(link(preprocessor(), engine), make_context(request))
    # one response: one head and one usage over both prompts
    _, _, usage = check_events(events)
    # the finish reasons of all four choices, by choice index
    assert usage == Usage(prompt_tokens=3, completion_tokens=4, finish_reasons=("stop",) * 4)
    whole = aggregate_completion(events)
    assert [(c["index"], c["text"]) for c in whole["choices"]] == [
        (0, "<5:0>"),
        (1, "<5:1>"),
        (2, "<6:0>"),
        (3, "<6:1>"),
    ]
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    # each prompt runs as its own leg: same request id, separate state scopes
    first, second = engine.requests
    assert first.id == second.id
    assert first.state is not second.state


async def test_downstream_error_propagates_without_a_synthetic_finish() -> None:
    error = EngineError("boom")
    engine = ScriptedEngine([out("a", delivered=1)], then=error)
    seen: list[OpenAIEvent] = []
    ctx = make_context(chat(stream=True, stream_options={"include_usage": True}))
    with pytest.raises(EngineError) as caught:
        async for event in link(preprocessor(), engine).generate(ctx):
            seen.append(event)
    assert caught.value is error
    head, *rest = seen
    assert isinstance(head, ResponseHead)
    assert rest == [ChoiceStart(0), ChoiceDelta(0, "a")]  # no finish, no Usage
    chunks = stream_chunks(seen, include_usage=True)
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"]] == [None, None]
    assert all(chunk["usage"] is None for chunk in chunks)


async def test_invalid_request_is_raised_before_anything_is_yielded() -> None:
    engine = ScriptedEngine([out("a", delivered=1)])
    ctx = make_context(completion(prompt=[1] * 9))
    seen: list[OpenAIEvent] = []
    with pytest.raises(InvalidRequest):
        async for event in link(preprocessor(max_model_len=4), engine).generate(ctx):
            seen.append(event)
    assert seen == []  # not even a ResponseHead
    assert engine.requests == []


async def test_a_consumer_stopping_after_the_first_choice_event_closes_downstream() -> None:
    # check_operator's early stop comes right after the ResponseHead, which is yielded
    # before downstream is called; this one stops once downstream is streaming.
    engine = ScriptedEngine([out("a", delivered=1), out("b", delivered=2)], then="hang")
    seen: list[OpenAIEvent] = []
    async with open_stream(link(preprocessor(), engine), make_context(chat(stream=True))) as s:
        async for event in s:
            seen.append(event)
            if isinstance(event, ChoiceDelta):
                break
    assert [type(event) for event in seen] == [ResponseHead, ChoiceStart, ChoiceDelta]
    assert len(engine.requests) == 1
    assert engine.closed_early
    assert engine.open_streams == 0


@pytest.mark.parametrize(
    "request_",
    [
        chat(n=2, logprobs=True, stream=True, stream_options={"include_usage": True}),
        completion(prompt=["a", "b"], logprobs=2),
    ],
    ids=["chat", "completion-batch"],
)
async def test_check_operator(request_: ChatCompletionRequest | CompletionRequest) -> None:
    outputs = [
        out("x", index=0, delivered=1, logprobs=True),
        out("y", index=1, delivered=1, logprobs=True),
        out("z", index=0, delivered=2, logprobs=True, finish="stop"),
        out("w", index=1, delivered=2, logprobs=True, finish="length"),
    ]
    await check_operator(lambda: preprocessor(), request_, outputs)


# ---------------------------------------------------------- with the real Backend


def echo_graph(**options: Any) -> Any:
    return link(
        preprocessor(**options),
        Backend(TOKENIZER),
        EchoEngine.from_tokenizer(TOKENIZER),
    )


async def test_streamed_and_whole_responses_agree_through_the_echo_graph() -> None:
    fields: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Hello 😀 there, friend"}],
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": [" fri"],
    }
    streamed = await collect(
        echo_graph(),
        make_context(chat(stream=True, stream_options={"include_usage": True}, **fields)),
    )
    whole_events = await collect(echo_graph(), make_context(chat(**fields)))
    check_events(streamed)
    check_events(whole_events)
    streamed_whole = aggregate_chat(streamed)
    whole = aggregate_chat(whole_events)
    for key in ("choices", "usage", "model"):
        assert streamed_whole[key] == whole[key]
    # what the streaming client received adds up to the whole response
    chunks = stream_chunks(streamed, include_usage=True)
    assert chunks[-1]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        mine = choices_of(chunks, choice["index"])
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
        assert [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]] == choice[
            "logprobs"
        ]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
    expected = TOKENIZER.decode(
        [
            i
            for i in TOKENIZER.encode(preprocessor().render_chat(chat(**fields)))
            if i not in TOKENIZER.special_token_ids
        ]
    )
    for choice in whole["choices"]:
        content = choice["message"]["content"]
        assert content == expected[: expected.index(" fri")]
        assert choice["finish_reason"] == "stop"
        # the logprob tokens spell the content: delivered tokens only, in order
        assert "".join(e["token"] for e in choice["logprobs"]["content"]) == content
    assert whole["usage"]["completion_tokens"] > sum(
        len(c["logprobs"]["content"]) for c in whole["choices"]
    )  # the swallowed " friend" tokens are counted, not shown


async def test_hidden_stop_through_the_backend_counts_swallowed_tokens() -> None:
    ids = TOKENIZER.encode("Hello there, friend of mine")
    engine = ScriptedEngine(
        [EngineOutput(token_ids=[i], logprobs=[-0.1], top_logprobs=[[(i, -0.1)]]) for i in ids]
        + [EngineOutput(token_ids=[], finish_reason="length")]
    )
    graph = link(preprocessor(), Backend(TOKENIZER), engine)
    request = completion(prompt="x", stop=[" friend"], logprobs=0)
    events = await collect(graph, make_context(request))
    _, _, usage = check_events(events)
    whole = aggregate_completion(events)
    [choice] = whole["choices"]
    assert choice["text"] == "Hello there,"
    assert choice["finish_reason"] == "stop"
    assert "".join(choice["logprobs"]["tokens"]) == "Hello there,"
    swallowed = ids.index(TOKENIZER.encode(" friend")[0]) + 1
    assert whole["usage"]["completion_tokens"] == swallowed == usage.completion_tokens


# ------------------------------------------------------------- stream vs aggregate


@st.composite
def scripts(draw: st.DrawFn) -> tuple[int, list[BackendOutput], dict[int, dict[str, Any]]]:
    """Random BackendOutput streams for n choices, interleaved, with delivery lagging."""
    n = draw(st.integers(1, 3))
    per_choice: dict[int, list[BackendOutput]] = {}
    expected: dict[int, dict[str, Any]] = {}
    piece = st.text(alphabet="ab é😀\n", max_size=3)
    for index in range(n):
        steps = draw(st.integers(1, 5))
        seen = delivered = 0
        outputs = []
        all_tokens: list[str] = []
        texts: list[str] = []
        for step in range(steps):
            tokens = draw(st.lists(piece, max_size=3))
            seen += len(tokens)
            last = step == steps - 1
            delivered = draw(st.integers(delivered, seen)) if seen else 0
            text = draw(piece)
            finish: FinishReason | None = (
                draw(st.sampled_from(["stop", "length"])) if last else None
            )
            ids = [100 + len(all_tokens) + i for i in range(len(tokens))]
            all_tokens.extend(tokens)
            texts.append(text)
            outputs.append(
                BackendOutput(
                    token_ids=ids,
                    tokens=tokens,
                    text=text,
                    logprobs=[-float(i) for i in ids],
                    top_logprobs=[[(i, -float(i)), (i + 1, -float(i) - 1)] for i in ids],
                    finish_reason=finish,
                    index=index,
                    delivered_tokens=delivered,
                )
            )
        per_choice[index] = outputs
        expected[index] = {
            "text": "".join(texts),
            "delivered": all_tokens[:delivered],
            "generated": len(all_tokens),
            "finish": outputs[-1].finish_reason,
        }
    order = draw(st.permutations([i for i, outs in per_choice.items() for _ in outs]))
    cursors = dict.fromkeys(per_choice, 0)
    interleaved = []
    for index in order:
        interleaved.append(per_choice[index][cursors[index]])
        cursors[index] += 1
    return n, interleaved, expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts(), top=st.integers(0, 2))
async def test_chat_aggregate_is_the_concatenation_of_the_stream(
    script: tuple[int, list[BackendOutput], dict[int, dict[str, Any]]], top: int
) -> None:
    n, outputs, expected = script
    request = chat(
        n=n, stream=True, logprobs=True, top_logprobs=top, stream_options={"include_usage": True}
    )
    events = await run(request, outputs)
    head, _, usage = check_events(events)
    chunks = stream_chunks(events, include_usage=request.include_usage)
    whole = aggregate_chat(events)
    assert [c["index"] for c in whole["choices"]] == list(range(n))
    for choice in whole["choices"]:
        want = expected[choice["index"]]
        mine = choices_of(chunks, choice["index"])
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        finishes = [c["finish_reason"] for c in mine if c["finish_reason"] is not None]
        assert finishes == [want["finish"]]
        assert mine[-1]["finish_reason"] == want["finish"]
        assert choice["message"]["content"] == want["text"]
        assert choice["message"]["content"] == "".join(c["delta"].get("content", "") for c in mine)
        entries = (choice["logprobs"] or {"content": []})["content"]
        assert [e["token"] for e in entries] == want["delivered"]
        assert [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]] == entries
        assert all(len(e["top_logprobs"]) == top for e in entries)
        assert choice["finish_reason"] == want["finish"]
    assert chunks[-1]["choices"] == []
    assert [chunk for chunk in chunks if chunk["usage"] is not None] == [chunks[-1]]
    assert chunks[-1]["usage"] == whole["usage"] == usage.as_dict()
    assert whole["usage"]["completion_tokens"] == sum(w["generated"] for w in expected.values())
    assert {chunk["id"] for chunk in chunks} == {head.id} == {whole["id"]}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
async def test_completion_aggregate_is_the_concatenation_of_the_stream(
    script: tuple[int, list[BackendOutput], dict[int, dict[str, Any]]],
) -> None:
    n, outputs, expected = script
    events = await run(completion(n=n, logprobs=1), outputs)
    _, _, usage = check_events(events)
    chunks = stream_chunks(events, include_usage=False)
    whole = aggregate_completion(events)
    assert [c["index"] for c in whole["choices"]] == list(range(n))
    for choice in whole["choices"]:
        want = expected[choice["index"]]
        mine = choices_of(chunks, choice["index"])
        assert choice["text"] == want["text"] == "".join(c["text"] for c in mine)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [want["finish"]]
        logprobs = choice["logprobs"] or {"tokens": [], "text_offset": []}
        assert logprobs["tokens"] == want["delivered"]
        assert [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]] == want[
            "delivered"
        ]
        offsets = [
            sum(len(t) for t in want["delivered"][:i]) for i in range(len(want["delivered"]))
        ]
        assert logprobs["text_offset"] == offsets
    assert whole["usage"] == usage.as_dict()
    assert whole["usage"]["completion_tokens"] == sum(w["generated"] for w in expected.values())


def test_aggregating_nothing_is_an_error() -> None:
    no_head: list[OpenAIEvent] = [Usage(prompt_tokens=1, completion_tokens=1)]
    for events in ([], no_head):
        with pytest.raises(ValueError, match="start with a ResponseHead"):
            aggregate_chat(events)
        with pytest.raises(ValueError, match="start with a ResponseHead"):
            aggregate_completion(events)
        with pytest.raises(ValueError, match="start with a ResponseHead"):
            stream_chunks(events, include_usage=True)
