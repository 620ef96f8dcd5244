"""Images in a Messages or Responses request reach the engine as the chat endpoint's do
(decoded, in order, out of the text), and a store of the user's own keeps the Responses
API's records."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

from operators.contracts.llm import EngineOutput, MultimodalItem, PreprocessedRequest
from operators.serving import build_app
from operators.testing import anthropic_client, openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, FunctionEngine

TOKENIZER = Tokenizer.default()
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(32))
GIF = b"GIF89a" + bytes(range(16))


def recording() -> tuple[Any, list[tuple[MultimodalItem, ...]], list[str]]:
    """An app whose engine records each request's images and prompt text, and says "ok"."""
    images: list[tuple[MultimodalItem, ...]] = []
    prompts: list[str] = []

    async def engine(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
        images.append(ctx.data.multimodal)
        prompts.append(TOKENIZER.decode(ctx.data.token_ids))
        yield EngineOutput(TOKENIZER.encode("ok"), finish_reason="stop")

    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    app = build_app(FunctionEngine(engine), TOKENIZER, model_name="m", chat_template=template)
    return app, images, prompts


async def test_messages_image_blocks_reach_the_engine() -> None:
    app, images, prompts = recording()
    content: Any = [
        {"type": "text", "text": "Compare"},
        {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/png",
                "data": base64.b64encode(PNG).decode(),
            },
        },
        {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/gif",
                "data": base64.b64encode(GIF).decode(),
            },
        },
    ]
    async with anthropic_client(app) as api:
        message = await api.messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": content}]
        )
    assert message.content[0].text == "ok"  # type: ignore[union-attr]
    [sent] = images
    assert [(item.mime_type, item.data) for item in sent] == [
        ("image/png", PNG),
        ("image/gif", GIF),
    ]
    assert prompts == ["[user]Compare"]  # (images stay out of the text)


async def test_responses_input_images_reach_the_engine() -> None:
    app, images, _ = recording()
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    content: Any = [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": url},
    ]
    async with openai_client(app) as api:
        response = await api.responses.create(
            model="m", input=[{"role": "user", "content": content}]
        )
    assert response.output_text == "ok"
    [sent] = images
    assert [(item.mime_type, item.data) for item in sent] == [("image/png", PNG)]


class DictStore:
    """A store of the user's own: three coroutines over a dict."""

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}

    async def get(self, key: str, /) -> bytes | None:
        return self.records.get(key)

    async def put(self, key: str, value: bytes, /) -> None:
        self.records[key] = value

    async def delete(self, key: str, /) -> bool:
        return self.records.pop(key, None) is not None


async def test_a_store_of_ones_own_keeps_the_responses() -> None:
    store = DictStore()
    engine = FunctionEngine(lambda ctx: _ok(ctx))
    app = build_app(engine, TOKENIZER, model_name="m", responses_store=store)
    async with openai_client(app) as api:
        first = await api.responses.create(model="m", input="hi")
        assert list(store.records) == [first.id]
        second = await api.responses.create(model="m", input="again", previous_response_id=first.id)
        assert (await api.responses.retrieve(second.id)).id == second.id
        await api.responses.delete(first.id)
    assert list(store.records) == [second.id]


async def _ok(ctx: Context[PreprocessedRequest]) -> AsyncIterator[EngineOutput]:
    yield EngineOutput(TOKENIZER.encode("ok"), finish_reason="stop")
