"""Serving the default graph from Python: one call builds the app, one serves it.

``build_app`` puts the default graph (preprocessor, Migration, Backend, routers) in front of
an engine, names the model once and wires the metrics; ``serve`` runs it over HTTP until
SIGINT/SIGTERM, or until its task is cancelled, as here once one request has been answered
through the official ``openai`` client.

Run it: ``python examples/serve_from_python.py``.
"""

from __future__ import annotations

import anyio
import openai

from operators.engines import EchoEngine
from operators.serving import build_app, serve
from operators.text.tokenizer import Tokenizer


async def main() -> None:
    tokenizer = Tokenizer.default()
    app = build_app(EchoEngine.from_tokenizer(tokenizer), tokenizer, model_name="echo")
    ready = anyio.Event()
    address: list[int] = []

    def on_ready(host: str, port: int) -> None:
        address.append(port)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(app, port=0, on_ready=on_ready, handle_signals=False))
        await ready.wait()
        url = f"http://127.0.0.1:{address[0]}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none") as client:
            reply = await client.completions.create(model="echo", prompt="Hello!", max_tokens=8)
        print(f"served on port {address[0]}: {reply.choices[0].text!r}")
        tg.cancel_scope.cancel()  # stops serve: the listening socket is closed
    print("stopped")


if __name__ == "__main__":
    anyio.run(main)
