"""``/v1/embeddings`` (through the engine's optional ``embed``), ``/tokenize`` and
``/detokenize``, driven by the official ``openai`` client and plain HTTP.

The engine here embeds each input as (sum of its ids, count): easy to check that the right
token ids reached it, in order, whatever shape the input came in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, InvalidRequest, Stream

TOKENIZER = Tokenizer.default()


class EchoThatEmbeds:
    """The echo engine, plus an ``embed`` that says which ids it was given."""

    def __init__(self) -> None:
        self._echo = EchoEngine.from_tokenizer(TOKENIZER)
        self.batches: list[list[list[int]]] = []

    def generate(self, ctx: Context[Any], /) -> Stream[Any]:
        return self._echo.generate(ctx)

    async def embed(self, token_ids: Sequence[Sequence[int]], /) -> list[list[float]]:
        self.batches.append([list(tokens) for tokens in token_ids])
        if any(len(tokens) > 50 for tokens in token_ids):
            raise InvalidRequest("too long for this engine", param="input.0")
        return [[float(sum(tokens)), float(len(tokens)), 0.5] for tokens in token_ids]


def served(engine: Any = None, **options: Any) -> Any:
    engine = EchoThatEmbeds() if engine is None else engine
    return build_app(engine, TOKENIZER, model_name="echo", **options)


def vector(text: str) -> list[float]:
    ids = TOKENIZER.encode(text, add_special_tokens=True)
    return [float(sum(ids)), float(len(ids)), 0.5]


async def test_every_input_shape_is_embedded_in_order() -> None:
    engine = EchoThatEmbeds()
    async with openai_client(served(engine)) as api:
        one = await api.embeddings.create(model="echo", input="Hello there")  # base64 (SDK)
        many = await api.embeddings.create(
            model="echo", input=["a cat", "a dog sat"], encoding_format="float"
        )
        ids = await api.embeddings.create(model="echo", input=[5, 6, 7], encoding_format="float")
        lists = await api.embeddings.create(
            model="echo", input=[[1, 2], [3]], encoding_format="float"
        )
    assert one.data[0].embedding == vector("Hello there")
    assert one.object == "list"
    assert one.model == "echo"
    assert [d.embedding for d in many.data] == [vector("a cat"), vector("a dog sat")]
    assert [d.index for d in many.data] == [0, 1]
    assert (
        many.usage.prompt_tokens
        == many.usage.total_tokens
        == len(TOKENIZER.encode("a cat")) + len(TOKENIZER.encode("a dog sat"))
    )
    assert ids.data[0].embedding == [18.0, 3.0, 0.5]
    assert [d.embedding for d in lists.data] == [[3.0, 2.0, 0.5], [3.0, 1.0, 0.5]]
    assert engine.batches[1] == [TOKENIZER.encode("a cat"), TOKENIZER.encode("a dog sat")]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "dimensions": 2}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input.0"),
        ({"input": [1, 2**31]}, "input.1"),
        ({"input": [[10**6]]}, "input"),
        ({"input": " x" * 60}, "input.0"),  # the engine's own refusal, by name
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
async def test_a_bad_embeddings_request_is_a_400_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=served()), base_url="http://app"
    ) as http:
        response = await http.post("/v1/embeddings", json={"model": "echo", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_an_engine_without_embed_answers_a_400_naming_model() -> None:
    async with openai_client(served(EchoEngine.from_tokenizer(TOKENIZER))) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            await api.embeddings.create(model="echo", input="hi")
    assert refused.value.body["param"] == "model"  # type: ignore[index]


TOOLS: Any = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "chat",
    [
        {"messages": [{"role": "user", "content": "Hello there"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief"},
                {"role": "user", "content": "What time is it?"},
            ],
            "tools": TOOLS,
        },
    ],
)
async def test_tokenize_counts_what_a_chat_request_uses(chat: dict[str, Any]) -> None:
    app = served()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://app"
    ) as http:
        counted = (await http.post("/tokenize", json={"model": "echo", **chat})).json()
        strings = (await http.post("/tokenize", json={**chat, "return_token_strs": True})).json()
        bare = (await http.post("/tokenize", json={**chat, "add_generation_prompt": False})).json()
    async with openai_client(app) as api:
        reply = await api.chat.completions.create(model="echo", max_tokens=1, **chat)
    assert reply.usage is not None
    assert counted["count"] == len(counted["tokens"]) == reply.usage.prompt_tokens
    assert counted["max_model_len"] is None
    assert strings["token_strs"] == [TOKENIZER.id_to_token(t) for t in counted["tokens"]]
    assert bare["count"] < counted["count"]  # no assistant opening
    assert counted["tokens"][: bare["count"]] == bare["tokens"]


async def test_tokenize_counts_what_a_completion_uses_and_detokenize_inverts_it() -> None:
    app = served(max_model_len=64)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://app"
    ) as http:
        counted = (await http.post("/tokenize", json={"prompt": "Hello <|im_end|> world"})).json()
        back = (await http.post("/detokenize", json={"tokens": counted["tokens"]})).json()
        bad = await http.post("/detokenize", json={"tokens": [1, 10**6]})
        both = await http.post("/tokenize", json={"prompt": "a", "messages": []})
        special = await http.post(
            "/tokenize",
            json={"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
        )
    async with openai_client(app) as api:
        reply = await api.completions.create(
            model="echo", prompt="Hello <|im_end|> world", max_tokens=1
        )
    assert reply.usage is not None
    assert counted["count"] == reply.usage.prompt_tokens
    assert counted["max_model_len"] == 64
    assert back == {"prompt": "Hello <|im_end|> world"}
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"
    assert both.status_code == 400
    assert special.status_code == 400
    assert special.json()["error"]["param"] == "add_special_tokens"
