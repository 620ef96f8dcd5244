"""Image content parts: data URLs decoded and checked, remote URLs only from allowed hosts."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from operators.contracts.llm import BackendOutput, PreprocessedRequest
from operators.edges.openai import OpenAIPreprocessor
from operators.edges.openai.images import ImagePolicy
from operators.edges.openai.protocol import ChatCompletionRequest
from operators.text.tokenizer import Tokenizer
from pipeline import InvalidRequest, link
from pipeline.testing import ScriptedEngine, collect, make_context

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
GIF = b"GIF89a" + b"\x01" * 16


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_with(*urls: str) -> ChatCompletionRequest:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": parts}], "stream": True}
    )


async def send(
    request: ChatCompletionRequest, policy: ImagePolicy | None = None
) -> PreprocessedRequest:
    engine = ScriptedEngine(
        [
            BackendOutput(
                token_ids=[1], tokens=["a"], text="a", finish_reason="stop", delivered_tokens=1
            )
        ]
    )
    pre = OpenAIPreprocessor(Tokenizer.default(), model_name="m", images=policy)
    await collect(link(pre, engine), make_context(request))
    data = engine.requests[0].data
    assert isinstance(data, PreprocessedRequest)
    return data


async def test_data_urls_become_multimodal_items_in_order_and_stay_out_of_the_text() -> None:
    sent = await send(chat_with(data_url(PNG), data_url(GIF, "image/gif")))
    assert [(i.kind, i.mime_type, i.data) for i in sent.multimodal] == [
        ("image", "image/png", PNG),
        ("image", "image/gif", GIF),
    ]
    text = Tokenizer.default().decode(sent.token_ids)
    assert "what is this?" in text
    assert "base64" not in text


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64" + base64.b64encode(PNG).decode(), "no ','"),
        ("data:image/png," + "abc", "base64-encoded"),
        ("data:image/png;base64,@@@notbase64@@@", "invalid base64"),
        (data_url(PNG, "image/tiff"), "unsupported image type"),
        (data_url(b"plain text, not an image", "image/png"), "not a valid image/png"),
        (data_url(PNG, "text/plain"), "unsupported image type"),
        ("ftp://example.com/x.png", "unsupported image URL scheme"),
        ("http://169.254.169.254/latest/meta-data", "not accepted from host '169.254.169.254'"),
        ("https://example.com/cat.png", "--allowed-image-hosts"),
        ("http://[::1", "malformed image URL"),
        ("https://[]/", "malformed image URL"),
        ("http://\u2100.com/", "malformed image URL"),
        ("https://[::1]:99999/x.png", "not accepted from host"),
    ],
)
async def test_bad_images_are_400s_naming_the_part(url: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        await send(chat_with(data_url(PNG), url))
    assert caught.value.param == "messages.0.content.2"


async def test_oversized_images_are_refused_before_decoding() -> None:
    policy = ImagePolicy(max_bytes=16)
    with pytest.raises(InvalidRequest, match="over the limit") as caught:
        await send(chat_with(data_url(PNG)), policy)
    assert caught.value.param == "messages.0.content.1"


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


@pytest.fixture
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_allowed_hosts_are_fetched(image_server: str) -> None:
    policy = ImagePolicy(allowed_hosts=frozenset({"127.0.0.1"}))
    sent = await send(chat_with(f"{image_server}/cat.png"), policy)
    assert [(i.mime_type, i.data) for i in sent.multimodal] == [("image/png", PNG)]
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        await send(chat_with(f"{image_server}/missing.png"), policy)
    with pytest.raises(InvalidRequest, match="not accepted from host"):
        await send(chat_with(f"{image_server}/cat.png"))
